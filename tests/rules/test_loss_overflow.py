"""A loss whose float16 value overflows while the step's gradients stay finite: one batch of
large targets (a regression's outlier) takes a loss computed on `.half()` values past 65504. It
was reported twice over, and neither as what it is: nonfinite with "the loss became inf" and the
series of the pow's smallest input (another hazard's number), and grad-explosion with "the
gradient norm jumped to 176 at step 10, 45x the median" and a clipping patch, for a norm that
was finite and fell back the next step. Now: nonfinite names the loss's float16 overflow at its
line, says the gradients stayed finite, and its fix computes the loss in float32;
grad-explosion is silent (the loss jumped with the norm and fell back)."""
from __future__ import annotations

from conftest import ONE_THREAD, audit

PROGRAM = '''
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)


def step(i):
    x = torch.randn(64, 8)
    y = x.sum(1, keepdim=True)
    if i == 10:
        y = y * 40  # one batch of large targets
    pred = model(x)
    loss = ((pred.DTYPE - y.DTYPE) ** 2).mean()  # LOSS LINE
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()
'''


def _audit(tmp_path, dtype: str):
    path = tmp_path / f"overflow_{dtype.strip('()')}.py"
    source = PROGRAM.replace("DTYPE", dtype)
    path.write_text(source)
    a = audit("run", f"{path}:step", "--steps", "16", "--no-profile", "--quiet", out=tmp_path / "out", env=ONE_THREAD)
    assert a.returncode == 0, a.stderr[-3000:]
    return a, source


def test_a_loss_overflowing_float16_with_finite_gradients_is_named_as_that(tmp_path):
    a, source = _audit(tmp_path, "half()")
    [f] = a.rule("nonfinite")
    line = f["locations"][0]["line"]
    assert "# LOSS LINE" in source.splitlines()[line - 1]
    assert f["message"].startswith("Step 10 of 16: the loss became inf.")
    assert "overflowed float16" in f["message"]
    assert "Its gradients stayed finite (norm " in f["message"]
    assert "smallest input" not in f["message"]  # (the pow's own hazard, not this one)
    assert f["fix"]["summary"].startswith("Compute the loss in float32")
    assert f["fix"]["config"] == {"loss.dtype": "float32"}
    ev = f["evidence"]
    norms = dict(ev["grad_norm_series"])
    assert 10 < norms[10] < float("inf") and norms[11] < norms[10] / 10  # finite, and back the step after
    assert a.rule("grad-explosion") == []


def test_the_same_loss_in_float32_is_silent(tmp_path):
    """The clean twin: the loss in float32 stays finite at the large batch (a jump of the loss
    that the norm followed and that fell back: not an explosion)."""
    a, _ = _audit(tmp_path, "float()")
    assert a.rule("nonfinite") == []
    assert a.rule("grad-explosion") == []
