"""Issue #80 item 4: a CPU-only program (no GPU here, none asked for anywhere in its code: a classic
CPU tutorial's loop) is told nothing of accelerators. host-sync said "On an accelerator these would
synchronise" of its `.item()`; its reads are now counted as what they are on the CPU."""
from __future__ import annotations

import re

import pytest

from conftest import audit

TUTORIAL = """import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
data = TensorDataset(torch.randn(1024, 1, 28, 28), torch.randint(0, 10, (1024,)))
loader = DataLoader(data, batch_size=32, shuffle=True)
model = nn.Sequential(nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
running_loss = 0.0
for epoch in range(2):
    for i, (inputs, labels) in enumerate(loader):
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = F.cross_entropy(outputs, labels)
        loss.backward()
        optimizer.step()
        running_loss += loss.item()  # ITEM LINE
        correct = (outputs.argmax(1) == labels).sum().item()  # CORRECT LINE
        if i % 10 == 9:
            print(f"[{epoch + 1}, {i + 1:5d}] loss: {running_loss / 10:.3f} correct: {correct}")
            running_loss = 0.0
"""
ACCELERATOR_WORDS = re.compile(r"accelerat|GPU|CUDA|cuda|kernel|synchronis|non_blocking|pin_memory", re.IGNORECASE)


def _line(marker: str) -> int:
    return next(i for i, t in enumerate(TUTORIAL.splitlines(), 1) if t.endswith(f"# {marker}"))


@pytest.mark.slow
def test_a_cpu_only_program_is_told_nothing_of_accelerators(tmp_path):
    (tmp_path / "tutorial.py").write_text(TUTORIAL)
    a = audit("run", "tutorial.py", "--steps", "8", "--no-profile", out=tmp_path / "out", cwd=tmp_path)
    assert a.returncode == 0, a.stderr[-3000:]
    assert a.findings_doc["environment"]["rehearsal"] is False
    [sync] = a.rule("host-sync")
    assert sync["severity"] == "info" and sync["evidence"]["judged_as_gpu_code"] is False
    assert [loc["line"] for loc in sync["locations"]] == [_line("ITEM LINE"), _line("CORRECT LINE")]
    assert sync["message"].startswith("Tensor values are read in the loop: read them less often. "
                                      "2 tensor values read on the host per step at 2 place(s): Tensor.item x1/step")
    assert "accumulate as a tensor" in sync["fix"]["summary"]
    for f in a.findings:
        for text in (f["message"], (f["fix"] or {}).get("summary") or "", (f["cost"] or {}).get("note") or ""):
            assert not ACCELERATOR_WORDS.search(text), (f["rule"], text)
    finding_lines = [ln for ln in a.stdout.splitlines() if ln.startswith(("info ", "warning ", "error "))]
    assert finding_lines and not any(ACCELERATOR_WORDS.search(ln) for ln in finding_lines), finding_lines
