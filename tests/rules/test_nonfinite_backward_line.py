"""The step where the gradients turned non-finite names a line in the user's code: when no checked
call reached a singular point (the infinities came from an overflow on the way back), the line
where that step's backward pass started (`loss.backward()`)."""
from __future__ import annotations

import pytest

from conftest import audit

OVERFLOWS_ON_THE_WAY_BACK = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(64, 1)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(256, 64)
push = torch.full((64,), 3e38)


def step(i):
    out = model(x)
    loss = out.square().mean()
    if i == 3:  # a penalty whose value is 0, whose gradient, taken twice, overflows float32
        w = model.weight[0]
        loss = loss + (push * (w - w.detach())).sum() + (push * (w - w.detach())).sum()
    opt.zero_grad()
    loss.backward()  # BACKWARD LINE
    opt.step()
"""


@pytest.mark.slow
def test_gradients_that_overflow_on_the_way_back_name_the_backward_line(tmp_path):
    """Steps 0-2 are the clean twin (the same step without the penalty): the rule is silent on them
    (the one finding's first step is 3, which it would not be had any of them been flagged)."""
    trainer = tmp_path / "overflow.py"
    trainer.write_text(OVERFLOWS_ON_THE_WAY_BACK)
    a = audit("run", f"{trainer}:step", "--steps", "6", "--no-profile", "--quiet", out=tmp_path / "out",
              env={"OMP_NUM_THREADS": "1"})
    assert a.returncode == 0, a.stderr[-2000:]
    [f] = a.rule("nonfinite")
    line = next(n for n, t in enumerate(OVERFLOWS_ON_THE_WAY_BACK.splitlines(), 1) if "BACKWARD LINE" in t)
    assert f["evidence"]["first_step"] == 3 and f["evidence"]["phase"] == "backward"
    assert f["message"] == ("Step 3 of 6: the gradient became non-finite (parameters followed). The forward pass "
                            "stayed finite; the backward pass made the gradients of `model.weight` non-finite (the "
                            "backward pass started at overflow.py:19: `loss.backward()  # BACKWARD LINE`)."), f["message"]
    assert [(loc["file"], loc["line"]) for loc in f["locations"]] == [(str(trainer), line)]
