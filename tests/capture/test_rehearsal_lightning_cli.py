"""Issue #80 item 2: the Trainer a LightningCLI builds (accelerator "auto" unless its
trainer_defaults or the command line say otherwise) takes the GPU when there is one, so a program
built on it is rehearsed as GPU code; it ran as CPU code."""
from __future__ import annotations

import pytest
import torch

from auditor.capture.rehearsal.intent import argument_reason, cli_accelerator, cuda_reasons
from conftest import ROOT, audit

if torch.cuda.is_available():  # pragma: no cover - rehearsal is for machines without a GPU
    pytest.skip("a CUDA device is present: nothing to rehearse", allow_module_level=True)

CLI = ROOT / "tests" / "data" / "public_shapes" / "lightning_cli.py"
PICKS = "(its Trainer picks a GPU when there is one)"


@pytest.mark.parametrize("source,asks", [
    ("from lightning.pytorch.cli import LightningCLI\nLightningCLI(Model, Data)", f"LightningCLI() {PICKS}"),
    ("from lightning.pytorch.cli import LightningCLI\n"
     "cli = LightningCLI(Model, trainer_defaults={'max_epochs': 3, 'accelerator': 'auto'})", f"LightningCLI() {PICKS}"),
    ("from lightning.pytorch.cli import LightningCLI\nLightningCLI(Model, trainer_defaults={'accelerator': 'cpu'})",
     None),
    ("import lightning.pytorch.cli as lc\nclass MyLightningCLI(lc.LightningCLI):\n    pass\nMyLightningCLI(Model)",
     f"MyLightningCLI() {PICKS}"),
    ("LightningCLI(Model)", None),  # (not Lightning's: the file imports no Lightning)
])
def test_a_lightning_cli_asks_for_the_gpu_unless_told_the_cpu(tmp_path, source, asks):
    f = tmp_path / "t.py"
    f.write_text(source + "\n")
    reasons = cuda_reasons(f)
    assert (reasons[0][1] if reasons else None) == asks


@pytest.mark.parametrize("argv,accelerator,asks", [
    (["--trainer.accelerator", "cpu"], "cpu", None),
    (["--trainer.max_epochs=2", "--trainer.accelerator=gpu"], "gpu", "'--trainer.accelerator=gpu'"),
    (["--trainer.accelerator", "cuda", "--trainer.devices", "2"], "cuda", "'--trainer.accelerator cuda'"),
    (["--trainer.max_epochs", "2"], None, None),
])
def test_the_cli_accelerator_is_read_from_the_command_line(argv, accelerator, asks):
    assert cli_accelerator(argv) == accelerator
    assert argument_reason(argv) == asks


@pytest.mark.slow
def test_a_lightning_cli_program_is_rehearsed_and_told_the_cpu_is_not(tmp_path):
    (tmp_path / CLI.name).write_text(CLI.read_text())
    a = audit("run", CLI.name, "--steps", "4", "--no-profile", "--no-numerics", out=tmp_path / "out", cwd=tmp_path)
    assert a.returncode == 0, a.stdout[-3000:]
    assert a.findings_doc["environment"]["rehearsal"] is True
    line = next(i for i, t in enumerate(CLI.read_text().splitlines(), 1) if "cli = LightningCLI(" in t)
    assert f"(LightningCLI() {PICKS} at line {line} of {CLI.name})" in a.stderr
    assert len(a.evidence["steps"]) == 4
    # its steps ran as GPU code: launches counted, the step on the device model's clock
    assert any(t["kind"] == "device-launch" for s in a.evidence["steps"] for t in s["tallies"])
    b = audit("run", CLI.name, "--steps", "4", "--no-profile", "--no-numerics", "--", "--trainer.accelerator", "cpu",
              out=tmp_path / "cpu", cwd=tmp_path)
    assert b.returncode == 0, b.stdout[-3000:]
    assert b.findings_doc["environment"]["rehearsal"] is False and "rehearsing" not in b.stderr
