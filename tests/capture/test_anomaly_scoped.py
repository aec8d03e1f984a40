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
CMS = ["torch.autograd.detect_anomaly()", "torch.autograd.set_detect_anomaly(True)"]


def scoped(cm: str) -> str:
    return f"    with {cm}:\n" + "\n".join("    " + line for line in PLAIN.splitlines())


def run(tmp_path, body: str):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER.format(body=body))
    return script, audit("run", f"{script}:step", "--steps", str(STEPS), "--quiet", out=tmp_path / "out")


@pytest.fixture(scope="module")
def both_scoped(tmp_path_factory):
    """One trainer whose step runs a forward and backward under each context manager in turn (each
    `with` at its own line): one audit for both."""
    return run(tmp_path_factory.mktemp("scoped"), "\n".join(scoped(cm) for cm in CMS))


def with_line(script, cm: str) -> int:
    return next(n for n, text in enumerate(script.read_text().splitlines(), 1) if text.strip() == f"with {cm}:")


@pytest.mark.parametrize("cm", CMS)
def test_anomaly_scoped_in_step_is_flagged_at_the_with_line(both_scoped, cm):
    script, a = both_scoped
    assert a.returncode == 0, a.stderr
    lines = [with_line(script, c) for c in CMS]
    line = with_line(script, cm)
    assert lines == [13, 16]  # (the first line of {body}, then the second `with`)
    # the step record's flag (read at the step's start) is off: the `with` switches it on later
    assert not any(s["anomaly_enabled"] for s in a.evidence["steps"])
    found = a.rule("anomaly-mode")
    assert len(found) == 1, [f["rule"] for f in a.findings]
    f = found[0]
    assert f["evidence"]["steps_with_anomaly"] == STEPS and f["evidence"]["steps"] == STEPS
    # each `with` named at its own line, switched on once a step
    assert [(loc["file"], loc["line"]) for loc in f["locations"]] == [(str(script), n) for n in lines]
    switched = {(p["file"], p["line"]): p["count"] for p in f["evidence"]["switched_on"]}
    assert switched == {(str(script), n): STEPS for n in lines}
    edits = {e["start"]: e["lines"][0] for e in f["fix"]["edits"]}
    if "set_detect_anomaly" in cm:  # the patch passes False; a detect_anomaly() block is removed by hand
        assert "set_detect_anomaly(False)" in edits[line]
    else:
        assert line not in edits
    assert len(edits) == 1


def test_anomaly_scoped_twin_without_it_is_silent(tmp_path):
    _, a = run(tmp_path, PLAIN)
    assert a.returncode == 0, a.stderr
    assert a.rule("anomaly-mode") == []
