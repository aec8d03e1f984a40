"""Checked, timed and profiled steps are kept apart (auditor.capture.numerics.schedule): the
profiler window and the timed steps carry none of the numerics checks (nor a graph scan), the
reported median is the timed steps', the audit's own cost is measured between them, and a loss that
turns non-finite on a step the checks did not see turns them on from the next step."""
from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path

import pytest

from auditor.capture.child import graph_scan_points, profile_plan
from tests.conftest import ONE_THREAD, shared_audit

STEPS = 34
TRAIN = '''import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(16, 8)


def step():
    loss = torch.log1p(model(x).pow(2)).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
'''
LATE_NAN = '''import torch

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
batches = [torch.rand(8, 4) + 0.5 for _ in range(40)]
batches[27][0, 0] = 0.0  # one batch with a zero: its log is -inf
state = {"i": 0}


def step():
    x = batches[state["i"]]
    state["i"] += 1
    feats = torch.log(x)
    loss = model(feats).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


def _audit(tmp_path_factory, name: str, source: str, *args: str):
    src = tmp_path_factory.getbasetemp() / f"{name}.py"
    if not src.exists():
        src.write_text(source)
    return shared_audit(tmp_path_factory, f"measured-{name}", "run", f"{src}:step", *args, "--quiet", env=ONE_THREAD)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return _audit(tmp_path_factory, "small", TRAIN, "--steps", str(STEPS))


@pytest.mark.slow
def test_profiled_and_timed_steps_carry_no_checks(run):
    a = run
    assert a.returncode == 0, a.stderr[-2000:]
    steps = a.evidence["steps"]
    profiled = [s["index"] for s in steps if s["profiled"]]
    checked = [s["index"] for s in steps if s["numerics"] is not None]
    assert profiled == [3, 4, 5, 6]
    # a run of 30 steps or more keeps 15 timed (schedule.dense_steps): the first 14 steps but the
    # window's, then one in 32 from step 18 (the next is 50)
    assert checked == [0, 1, 2, *range(7, 19)]
    # the window's trace is the program's: none of the checks' reductions or ranges in it
    trace = next(Path(a.out, "tb").rglob("*.pt.trace.json*"))
    text = (gzip.open if trace.suffix == ".gz" else open)(trace, "rt").read()
    events = json.loads(text)["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("aten::addmm") or n == "aten::linear" for n in names)  # (the program is in it)
    assert not [n for n in names if "aminmax" in n or "auditor::numerics" in n]
    # nor the graph scan: the one planned after step 4 runs after the window's last step, 6
    assert sorted(s["after_step"] for s in a.evidence["graph_scans"]) == [1, 6, 16, 17, 33]
    assert not [n for n in names if "auditor/capture/graphs.py" in n]


def test_no_graph_scan_is_planned_inside_the_window():
    """Every run length to 300: no scan after a window step but its last (it would run while the
    profiler records), the planned scans kept but where one merges with another, and a run whose
    window begins after step 0 scanned once before it (the baseline a run failing there keeps)."""
    for steps in range(1, 301):
        warm, active = profile_plan(steps)
        window = ([warm] if warm is not None else []) + active
        planned, points = graph_scan_points(steps), graph_scan_points(steps, window)
        if window[0] > 0:
            assert not [p for p in points if window[0] <= p < window[-1]], (steps, window, sorted(points))
            assert min(points) < window[0], (steps, window, sorted(points))
        else:  # (5-7 steps: no step before the window)
            assert points == planned, steps
        assert len(planned) - 1 <= len(points) <= len(planned) and max(points) == steps - 1, steps


@pytest.mark.slow
def test_the_median_and_the_own_cost_are_measured_between_steps(run):
    a = run
    steps = a.evidence["steps"]
    timed = [s for s in steps if not s["profiled"] and s["numerics"] is None]
    assert [s["index"] for s in timed] == list(range(19, 34))
    doc = a.findings_doc["steps"]
    assert doc["median_ms"] == round(statistics.median(s["ms"] for s in timed), 3)
    cost = doc["own_cost"]
    assert cost["timed_steps"] == [s["index"] for s in timed] and cost["profiled_steps"] == [3, 4, 5, 6]
    checked_ms = statistics.median(s["ms"] for s in steps if s["numerics"] is not None)
    assert cost["checked_ms"] == round(checked_ms, 3)
    summary = (a.out / "summary.txt").read_text()
    assert "inside the auditor's numerics checks" not in summary
    assert (f"the audit's own cost, measured: 15 step(s) with numerics checks {cost['checked_ms']:.2f} ms median"
            in summary), summary
    assert f"the 15 timed step(s)' {cost['timed_ms']:.2f} ms" in summary
    assert f"4 profiled step(s) {cost['profiled_ms']:.2f} ms median" in summary


@pytest.mark.slow
def test_a_loss_that_turns_nonfinite_unchecked_turns_the_checks_on(tmp_path_factory):
    """Step 27 is timed (unchecked): its loss, read once its time is taken, is -inf, so every
    later step is checked (28, 29, ... where the schedule would check none before 47)."""
    a = _audit(tmp_path_factory, "late_nan", LATE_NAN, "--steps", "31", "--no-profile")
    assert a.returncode == 0, a.stderr[-2000:]
    steps = a.evidence["steps"]
    assert [s["index"] for s in steps if s["numerics"] is None] == list(range(16, 28))
    assert {"event": "unchecked-nonfinite-loss", "step": 27} in steps[28]["numerics"]["events"]
    f = next(f for f in a.findings if f["rule"] == "nonfinite")
    assert f["evidence"]["first_step"] == 27, f["evidence"]
    assert "Step 28 of 31" in f["message"] and "step 27, which the checks did not see" in f["message"], f["message"]
