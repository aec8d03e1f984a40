"""`torch.accelerator`'s memory calls are judged as their torch.cuda twins: PyTorch's own examples now
write `torch.accelerator.empty_cache()` and `reset_peak_memory_stats()`, and per step they cost a GPU
what torch.cuda's do (they were answered as stand-ins and named by no rule)."""
from __future__ import annotations

import pytest
import torch

from conftest import audit

if torch.cuda.is_available():  # pragma: no cover - rehearsal is for machines without a GPU
    pytest.skip("a CUDA device is present: nothing to rehearse", allow_module_level=True)

PROGRAM = """import torch
dev = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")
model = torch.nn.Linear(64, 64).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for i in range(20):
    model(torch.randn(32, 64, device=dev)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    torch.accelerator.empty_cache()
    torch.accelerator.reset_peak_memory_stats()
    peak = torch.accelerator.max_memory_allocated()
"""


@pytest.mark.slow
def test_accelerator_memory_calls_every_step_are_found(tmp_path):
    (tmp_path / "train.py").write_text(PROGRAM)
    a = audit("run", str(tmp_path / "train.py"), "--steps", "6", "--no-profile", "--no-numerics", "--quiet",
              out=tmp_path / "out", cwd=tmp_path)
    assert a.returncode == 0, a.stderr
    [cleanup] = a.rule("forced-cleanup")
    assert [(loc["line"], c["what"], c["count"]) for loc, c in zip(cleanup["locations"], cleanup["evidence"]["calls"])] \
        == [(9, "torch.accelerator.empty_cache", 6)]
    assert cleanup["cost"]["measured"] is False  # counted: no device here to time it on
    [reset] = a.rule("peak-stats-reset")
    assert reset["locations"][0]["line"] == 10 and "torch.accelerator.reset_peak_memory_stats() ran 6 times" in reset["message"]
