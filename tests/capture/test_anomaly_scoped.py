"""anomaly-mode for anomaly detection switched on inside the step, in a `with` block around forward
and backward: the flag read at each step's start is off, yet every step's backward runs under it."""
from __future__ import annotations

import pytest

from conftest import audit

STEPS = 12

TRAINER = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 32), torch.randint(0, 4, (64,))


def step(i):
    opt.zero_grad(set_to_none=True)
{body}
    opt.step()
'''
PLAIN = '''\
    loss = F.cross_entropy(model(x), y)
    loss.backward()'''
WITH_LINE = 13  # the `with` line of the scoped trainers (the first line of {body})


def scoped(cm: str) -> str:
    return f"    with {cm}:\n" + "\n".join("    " + line for line in PLAIN.splitlines())


def run(tmp_path, body: str):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER.format(body=body))
    return script, audit("run", f"{script}:step", "--steps", str(STEPS), "--quiet", out=tmp_path / "out")


@pytest.mark.parametrize("cm", ["torch.autograd.detect_anomaly()", "torch.autograd.set_detect_anomaly(True)"])
def test_anomaly_scoped_in_step_is_flagged_at_the_with_line(tmp_path, cm):
    script, a = run(tmp_path, scoped(cm))
    assert a.returncode == 0, a.stderr
    assert script.read_text().splitlines()[WITH_LINE - 1].strip() == f"with {cm}:"
    # the step record's flag (read at the step's start) is off: the `with` switches it on later
    assert not any(s["anomaly_enabled"] for s in a.evidence["steps"])
    found = a.rule("anomaly-mode")
    assert len(found) == 1, [f["rule"] for f in a.findings]
    f = found[0]
    assert f["evidence"]["steps_with_anomaly"] == STEPS and f["evidence"]["steps"] == STEPS
    assert [(loc["file"], loc["line"]) for loc in f["locations"]] == [(str(script), WITH_LINE)]
    assert [(p["file"], p["line"]) for p in f["evidence"]["switched_on"]] == [(str(script), WITH_LINE)]
    edits = f["fix"]["edits"]
    if "set_detect_anomaly" in cm:  # the patch passes False; a detect_anomaly() block is removed by hand
        assert "set_detect_anomaly(False)" in "".join(e["lines"][0] for e in edits)
    else:
        assert edits == []


def test_anomaly_scoped_twin_without_it_is_silent(tmp_path):
    _, a = run(tmp_path, PLAIN)
    assert a.returncode == 0, a.stderr
    assert a.rule("anomaly-mode") == []
