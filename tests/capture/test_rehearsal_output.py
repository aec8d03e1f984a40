"""Issue #80 item 6: what the rehearsal makes torch or a framework print stays out of the program's
output (Lightning's Tensor Cores hint naming 'CUDA device rehearsed on the CPU', its
CUDA_VISIBLE_DEVICES line, CPU autocast refusing the float32 a GPU trainer's autocast asks for);
the program's own prints and warnings stay as a plain run gives them."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import audit

if torch.cuda.is_available():  # pragma: no cover - rehearsal is for machines without a GPU
    pytest.skip("a CUDA device is present: nothing to rehearse", allow_module_level=True)

# llm.c train_gpt2.py's shape: autocast on CUDA only, in the dtype `--dtype` names (float32 by default)
AUTOCAST = """import warnings
from contextlib import nullcontext
import torch
device = "cuda" if torch.cuda.is_available() else "cpu"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}["float32"]
ctx = torch.amp.autocast(device_type=device, dtype=ptdtype) if device == "cuda" else nullcontext()
torch.manual_seed(0)
model = torch.nn.Linear(16, 4).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
warnings.warn("the program's own warning")
for step in range(6):
    with ctx:
        loss = model(torch.randn(8, 16, device=device)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step}: loss {loss.item():.6f}")
"""


def _lines(text: str, start: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(start)]


@pytest.mark.slow
def test_cpu_autocast_refusing_a_gpu_dtype_is_not_the_programs_output(tmp_path):
    (tmp_path / "train.py").write_text(AUTOCAST)
    a = audit("run", "train.py", "--steps", "4", "--no-profile", "--no-numerics", out=tmp_path / "out", cwd=tmp_path)
    assert a.returncode == 0, a.stderr[-3000:]
    assert a.findings_doc["environment"]["rehearsal"] is True
    assert "In CPU autocast" not in a.stderr + a.stdout and "target dtype is not supported" not in a.stderr
    plain = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": ""})
    # the program's own warning and prints as a plain run gives them (the same numbers: float32 both ways)
    warned = [ln for ln in a.stderr.splitlines() if "train.py:10: UserWarning" in ln]
    assert warned == [ln for ln in plain.stderr.splitlines() if "train.py:10: UserWarning" in ln] != []
    printed = [ln for ln in _lines(a.stdout, "step ") if ": loss " in ln]
    assert len(printed) >= 3 and printed == _lines(plain.stdout, "step ")[:len(printed)]


LIGHTNING = """import warnings
import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(16, 4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if batch_idx == 0:
            print("first batch")
            warnings.warn("the program's own warning")
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(256, 16, generator=g), torch.randint(0, 4, (256,), generator=g))
trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_model_summary=False,
                    enable_progress_bar=False)
trainer.fit(Model(), DataLoader(data, batch_size=16))
"""


@pytest.mark.slow
def test_what_lightning_logs_only_for_the_rehearsed_gpu_goes_to_the_report(tmp_path):
    (tmp_path / "fit.py").write_text(LIGHTNING)
    a = audit("run", "fit.py", "--steps", "4", "--no-profile", "--no-numerics", out=tmp_path / "out", cwd=tmp_path)
    assert a.returncode == 0, a.stderr[-3000:]
    assert a.findings_doc["environment"]["rehearsal"] is True
    output = a.stdout + a.stderr
    assert "Tensor Cores" not in output and "CUDA_VISIBLE_DEVICES" not in output
    assert "rehearsed on the CPU')" not in output
    [note] = [n for n in a.findings_doc["environment"]["notes"] if n.startswith("the CUDA rehearsal kept 2 line(s)")]
    assert "that has Tensor Cores" in note and "LOCAL_RANK: 0 - CUDA_VISIBLE_DEVICES: [" in note
    # the program's own output, and Lightning's lines a plain run prints too, are all there
    assert _lines(a.stdout, "first batch") == ["first batch"]
    assert len([ln for ln in output.splitlines() if "fit.py:17:" in ln and "the program's own warning" in ln]) == 1
    assert "GPU available: True (cuda), used: True" in output
