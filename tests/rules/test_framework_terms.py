"""Issue #80 item 5: advice in the framework's (or the script's own) terms.

fabric_classifier.py (Lightning's examples/fabric/image_classifier shape): Fabric moves the batches
(`fabric.setup_dataloaders`), so dataloader-bound must not say to copy them with
`.to(device, non_blocking=True)`; mixed precision is `Fabric(precision="bf16-mixed")`. gpt_flags.py
(llm.c train_gpt2.py's shape): its own `--compile` and `--dtype` options are the switches."""
from __future__ import annotations

import pytest
import torch

from auditor.rules._support.cli_flags import own_flag
from auditor.rules._support.frameworks import framework_moves_batches, trains_with
from conftest import ROOT, audit

if torch.cuda.is_available():  # pragma: no cover - these programs are rehearsed
    pytest.skip("a CUDA device is present: nothing to rehearse", allow_module_level=True)

SHAPES = ROOT / "tests" / "data" / "public_shapes"


def marked(name: str, marker: str) -> int:
    return next(i for i, t in enumerate((SHAPES / name).read_text().splitlines(), 1) if t.endswith(f"# {marker}"))


@pytest.mark.slow
def test_under_fabric_the_advice_names_fabric_not_a_copy_of_the_users(tmp_path):
    name = "fabric_classifier.py"
    (tmp_path / name).write_text((SHAPES / name).read_text())
    a = audit("run", name, "--steps", "8", "--no-profile", "--no-numerics", out=tmp_path / "out", cwd=tmp_path)
    assert a.returncode == 0, a.stdout[-3000:]
    assert a.findings_doc["environment"]["rehearsal"] is True
    [loader] = a.rule("dataloader-bound")
    assert loader["locations"][0]["line"] == marked(name, "LOADER LINE")
    summary = loader["fix"]["summary"]
    assert "non_blocking" not in summary.replace("without blocking", "") and ".to(device" not in summary, summary
    assert (f"`fabric.setup_dataloaders` (line {marked(name, 'SETUP LINE')}) moves the batches to the device "
            "itself") in summary
    assert loader["fix"]["config"]["DataLoader.pin_memory"] is True
    [amp] = a.rule("amp-opportunity")
    assert amp["fix"]["summary"].startswith(
        f'Run it in mixed precision through Fabric: `Fabric(..., precision="bf16-mixed")` at line '
        f'{marked(name, "FABRIC LINE")}')
    assert "torch.autocast" not in amp["fix"]["summary"]
    assert amp["fix"]["config"] == {"Fabric.precision": "bf16-mixed"}


TRAINER = """import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(2048, 256, generator=g), torch.randint(0, 10, (2048,), generator=g))
trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_model_summary=False,
                    enable_progress_bar=False)
trainer.fit(Model(), DataLoader(data, batch_size=128))
"""


@pytest.mark.slow
def test_under_a_trainer_mixed_precision_is_its_precision_setting(tmp_path):
    (tmp_path / "fit.py").write_text(TRAINER)
    a = audit("run", "fit.py", "--steps", "6", "--no-profile", "--no-numerics", out=tmp_path / "out", cwd=tmp_path)
    assert a.returncode == 0, a.stdout[-3000:]
    [amp] = a.rule("amp-opportunity")
    assert amp["fix"]["summary"].startswith(
        'Run it in mixed precision through Trainer: `Trainer(..., precision="bf16-mixed")` at line 22'), amp["fix"]
    assert amp["fix"]["config"] == {"Trainer.precision": "bf16-mixed"}


@pytest.mark.slow
def test_a_script_with_its_own_compile_and_dtype_options_is_told_to_use_them(tmp_path):
    name = "gpt_flags.py"
    (tmp_path / name).write_text((SHAPES / name).read_text())
    a = audit("run", name, "--steps", "6", "--no-profile", "--no-numerics", "--", "--num_iterations", "20",
              out=tmp_path / "out", cwd=tmp_path)
    assert a.returncode == 0, a.stdout[-3000:]
    [launch] = a.rule("launch-bound")
    assert launch["locations"][0]["line"] == marked(name, "TOKEN LINE")
    summary = launch["fix"]["summary"]
    assert (f"The script compiles its model with torch.compile itself when run with `--compile 1` (its option at "
            f"line {marked(name, 'COMPILE LINE')} of {name}): run it so.") in summary, summary
    assert 'torch.compile(mode="reduce-overhead")' not in summary
    assert launch["fix"]["config"]["--compile"] == "1" and "torch.compile" not in launch["fix"]["config"]
    [amp] = a.rule("amp-opportunity")
    assert amp["fix"]["summary"].startswith(f"Run it with its own `--dtype bfloat16` (its option at line "
                                            f"{marked(name, 'DTYPE LINE')} of {name}")
    assert amp["fix"]["config"] == {"--dtype": "bfloat16"}
    # told the option already, the script is not told it again
    b = audit("run", name, "--steps", "6", "--no-profile", "--no-numerics", "--", "--num_iterations", "20",
              "--dtype=float16", out=tmp_path / "out2", cwd=tmp_path)
    assert b.returncode == 0, b.stdout[-3000:]
    assert all("--dtype" not in f["fix"]["summary"] for f in b.rule("amp-opportunity"))


def test_the_switches_are_read_only_where_the_program_declares_them(tmp_path):
    plain = tmp_path / "plain.py"
    plain.write_text("import argparse\np = argparse.ArgumentParser()\np.add_argument('--lr', type=float)\n"
                     "p.add_argument('--dtype', default='float32', help='float32|float16')\n"
                     "Trainer = dict\nt = Trainer(precision=16)\n")
    assert own_flag([str(plain)], "compile") is None
    assert own_flag([str(plain)], "dtype", "bfloat16") is None  # (its dtype option names no bfloat16)
    assert trains_with([str(plain)]) is None  # (a Trainer, but the file imports no Lightning)
    flags = tmp_path / "flags.py"
    flags.write_text("import argparse\np = argparse.ArgumentParser()\np.add_argument('--compile', action='store_true')\n"
                     "from lightning.fabric import Fabric\nfabric = Fabric(precision='32-true')\n"
                     "a, b = fabric.setup_dataloaders(x, y, move_to_device=False)\n")
    assert own_flag([str(flags)], "compile").usage == "--compile"
    trains = trains_with([str(flags)])
    assert (trains.kind, trains.line, trains.precision, trains.moves_batches) == ("fabric", 5, "32-true", None)
    assert framework_moves_batches(trains) is None  # (move_to_device=False: the program copies them)
    trainer = tmp_path / "trainer.py"
    trainer.write_text("import lightning.pytorch as pl\ntrainer = pl.Trainer(max_epochs=1)\n")
    assert framework_moves_batches(trains_with([str(trainer)])).startswith("Lightning's Trainer moves the batches")
