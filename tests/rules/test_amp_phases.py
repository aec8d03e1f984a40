"""amp-unscaled judges each step (pytorch/tutorials' mixed_precision: the same network trained
in float32, then under float16 autocast alone, then with a GradScaler too). The rule returned as
soon as one checked step scaled its loss, so the steps trained unscaled before the scaler were
never reported; and the autocast region a loop enters before its forward pass, which the step
finder counts in the step before (a step ends at the next iteration's forward), counted that
step as one of float16 too."""
from __future__ import annotations

import pytest

from conftest import ONE_THREAD, audit

pytestmark = pytest.mark.slow

PLAIN, UNSCALED, SCALED = 3, 5, 4
PHASES = f'''import torch

torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))
opt = torch.optim.SGD(net.parameters(), lr=0.001)
data = [(torch.randn(16, 32), torch.randn(16, 32)) for _ in range(8)]
loss_fn = torch.nn.MSELoss()

for x, y in data[:{PLAIN}]:
    loss = loss_fn(net(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()

for x, y in data[:{UNSCALED}]:
    with torch.autocast("cpu", dtype=torch.float16):  # UNSCALED LINE
        loss = loss_fn(net(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()

scaler = torch.amp.GradScaler("cpu")
for x, y in data[:{SCALED}]:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loss_fn(net(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
'''


def test_steps_trained_unscaled_before_a_scaler_are_reported(tmp_path):
    (tmp_path / "phases.py").write_text(PHASES)
    a = audit("run", str(tmp_path / "phases.py"), "--steps", "40", "--to-end", "--no-profile", "--quiet",
              out=tmp_path / "out", env=ONE_THREAD)
    assert a.returncode == 0, a.stderr[-3000:]
    steps = a.evidence["steps"]
    assert len(steps) == PLAIN + UNSCALED + SCALED and all(s["numerics"] is not None for s in steps)
    [f] = a.rule("amp-unscaled")
    ev = f["evidence"]
    # the float16 steps are the unscaled phase's, not the last float32 step that entered its region
    assert ev["steps"] == UNSCALED and ev["backward_calls"] == UNSCALED and ev["steps_run"] == len(steps)
    line = next(n for n, text in enumerate(PHASES.splitlines(), 1) if "UNSCALED LINE" in text)
    assert [loc["line"] for loc in f["locations"]] == [line]
    assert (f"no GradScaler scaled the loss in them (one did in {SCALED} other checked step(s), "
            f"from step {PLAIN + UNSCALED})") in f["message"], f["message"]
    # each step's record: autocast entered in the float16 phases' steps only
    used = [bool(s["numerics"]["autocast"]) for s in steps]
    assert used == [False] * PLAIN + [True] * (UNSCALED + SCALED)
