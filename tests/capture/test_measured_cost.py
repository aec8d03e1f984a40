"""Checked, timed and profiled steps are kept apart (auditor.capture.numerics.schedule): the
profiler window and the timed steps carry none of the numerics checks (nor a graph scan), the
reported median is the timed steps', the audit's own cost is measured between them, a program that
makes -inf by design is not alarmed, and a loss that turns non-finite on a step the checks did not
see turns them on from the next step."""
from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path

import pytest

from auditor.capture.child import graph_scan_points, profile_plan
from tests.conftest import ONE_THREAD, shared_audit

STEPS = 34
CAUSAL = '''import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
T, C = 8, 16


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention without flash: the mask fills the future with -inf on every step."""

    def __init__(self):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.register_buffer("bias", torch.tril(torch.ones(T, T)).view(1, 1, T, T))

    def forward(self, x):
        B, T_, _ = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T_, 2, C // 2).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (C // 2) ** 0.5)
        att = att.masked_fill(self.bias[:, :, :T_, :T_] == 0, float("-inf"))  # MASKED_FILL LINE
        att = F.softmax(att, dim=-1)
        # the attention's entropy, logged: log of the exact zeros the mask left, guarded (out of
        # the loss: the guard's gradient would be 0 * inf, a NaN)
        p = att.detach()
        ent = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1).mean()  # LOG LINE
        y = (att @ v).transpose(1, 2).contiguous().view(B, T_, C)
        return self.c_proj(y), ent


attn = CausalSelfAttention()
head = nn.Linear(C, 1)
future = torch.full((T, T), float("-inf")).triu(1)  # FULL LINE: an additive causal mask
opt = torch.optim.AdamW([*attn.parameters(), *head.parameters()], lr=1e-3)
for i in range(1000):
    x = torch.randn(4, T, C)
    y, ent = attn(x)
    scores = (y @ y.transpose(1, 2) + future).softmax(-1)  # ADD LINE
    loss = head(scores @ y).pow(2).mean()
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
    """CAUSAL, a whole program, audited for STEPS steps, profiled: the tests of the window and the
    timed steps and the test of its by-design -inf read the one run."""
    src = tmp_path_factory.getbasetemp() / "causal.py"
    if not src.exists():
        src.write_text(CAUSAL)
    return shared_audit(tmp_path_factory, "measured-causal", "run", str(src), "--steps", str(STEPS), "--quiet",
                        env=ONE_THREAD)


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
    assert any(n.startswith("aten::masked_fill") for n in names) and any(n.startswith("aten::_softmax") for n in names)
    assert not [n for n in names if "aminmax" in n or "auditor::numerics" in n]
    # nor the graph scan: the one planned after step 4 runs after the window's last step, 6 (16, in
    # the run's middle third, is its middle scan)
    assert sorted(s["after_step"] for s in a.evidence["graph_scans"]) == [1, 6, 16, 33]
    assert not [n for n in names if "auditor/capture/graphs.py" in n]


def test_no_graph_scan_is_planned_inside_the_window():
    """Every run length to 300: no scan after a window step but its last (it would run while the
    profiler records), the planned scans kept but where one merges with another, a run whose
    window begins after step 0 scanned once before it (the baseline a run failing there keeps), and
    one whose window begins at step 0 (5-7 steps) scanned after that step, its calibration's."""
    for steps in range(1, 301):
        warm, active = profile_plan(steps)
        window = ([warm] if warm is not None else []) + active
        planned, points = graph_scan_points(steps), graph_scan_points(steps, window)
        # (none after a kept window step but its last; the warm-up step's recording is the calibration's, stopped
        # at its end)
        assert not [p for p in points if active[0] <= p < window[-1]], (steps, window, sorted(points))
        if window[0] > 0:
            assert min(points) < window[0], (steps, window, sorted(points))
        elif len(window) > 2:  # (5-7 steps: the window's first step is its calibration's, scanned after it)
            assert min(points) == 0 and len(points) == len(planned), (steps, window, sorted(points))
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
    # the profiled steps, which carry no checks, are set against the timed steps, which carry none
    # either: against every unprofiled step, the checked ones' cost (17.6x a step in minGPT's
    # adder) made its profiled steps read "72% faster ...: the machine's load changed"
    assert cost["profile_base"] == "timed" and cost["unprofiled_ms"] == cost["timed_ms"], cost
    profiled = summary.split(f"4 profiled step(s) {cost['profiled_ms']:.2f} ms median (")[1].split(";")[0]
    assert profiled.endswith(f"the 15 timed step(s)' {cost['timed_ms']:.2f} ms") or (
        profiled.startswith("the profiled steps ran") and "the 15 timed step(s)'" in profiled), profiled


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




@pytest.mark.slow
def test_a_causal_masks_minus_inf_leaves_the_later_steps_timed(run):
    """A nanoGPT-style program makes -inf by design on every step (masked_fill of the causal mask,
    the sum with an additive torch.full(-inf).triu(1) mask, log of the exact zeros the softmax
    leaves, under a guard). The checks see them (checked steps record non-finite outputs at those
    lines, the loss finite) but the run is not alarmed: the steps after the dense start are unchecked but one in 32,
    timed, the median is theirs, and no nonfinite finding is made."""
    from auditor.capture.numerics.schedule import checked as scheduled
    from auditor.capture.numerics.schedule import dense_steps

    steps = STEPS
    a = run
    assert a.returncode == 0, a.stderr[-2000:]
    recs = a.evidence["steps"]
    assert len(recs) == steps
    # the by-design -inf was seen: non-finite outputs recorded at the mask's, the log's and the full's lines
    seen = [s for s in recs if s["numerics"] is not None and s["numerics"]["nonfinite_ops"]]
    assert seen and all(s["numerics"]["loss_finite"] is True for s in seen)
    sites = {}  # (each step record carries the sites it named first)
    for s in recs:
        sites.update((s["numerics"] or {}).get("sites", {}))
    made = {sites[str(i)]["where"]["line"] for s in seen for i in s["numerics"]["nonfinite_sites"]}
    assert made == {n for n, text in enumerate(CAUSAL.splitlines(), 1)
                    if any(m in text for m in ("# MASKED_FILL LINE", "# LOG LINE", "# ADD LINE"))}, made
    # not alarmed: the checked steps are the schedule's for a healthy run with the profiler's window,
    # the others timed (but the window's)
    window = frozenset(s["index"] for s in recs if s["profiled"])
    assert window == {3, 4, 5, 6}
    checked = [s["index"] for s in recs if s["numerics"] is not None]
    assert checked == [i for i in range(steps) if scheduled(i, window, False, dense_steps(steps, window))]
    timed = [s for s in recs if s["numerics"] is None and not s["profiled"]]
    assert timed
    assert not any(e.get("event") == "unchecked-nonfinite-loss" for s in seen for e in s["numerics"]["events"])
    assert a.findings_doc["steps"]["median_ms"] == round(statistics.median(s["ms"] for s in timed), 3)
    assert a.findings_doc["steps"]["own_cost"]["timed_steps"] == [s["index"] for s in timed]
    assert not a.rule("nonfinite")
    assert "no step without them to compare" not in (a.out / "summary.txt").read_text()


def test_the_steady_state_pays_for_one_middle_scan():
    """A power of 4 in the run's middle third is its middle scan (none is added at steps // 2): a
    160-step audit scans after 1, 4, 16, 64 and 159, so its steady state after the dense start pays
    for one scan, not two; and every run of 3 steps or more keeps the three scans graph-leak judges
    its trend over, the middle one in the middle third."""
    from auditor.evidence.model import GraphScan
    from auditor.rules._support.scans import spread_scans

    assert sorted(graph_scan_points(160)) == [1, 4, 16, 64, 159]
    assert sorted(graph_scan_points(200)) == [1, 4, 16, 64, 100, 199]  # (64 is outside 67-133)
    for steps in range(3, 3000):
        points = sorted(graph_scan_points(steps))
        first, middle, last = spread_scans([GraphScan(after_step=p, tensors=0, graph_nodes=0) for p in points])
        assert (first.after_step, last.after_step) == (points[0], steps - 1), steps
        assert steps / 3 <= middle.after_step <= 2 * steps / 3, (steps, points)
        assert len([p for p in points[1:-1] if steps / 3 <= p <= 2 * steps / 3]) == 1, (steps, points)


def test_a_long_run_is_checked_half_as_often_after_each_16_checks_twice_then_one_step_in_128():
    """numerics.schedule with capture.cadence: past the dense start, one step in 32 for 16 checks
    (the run's first 536 steps read as closely as before), one in 64 for 16 more, then one in 128
    for good; an alarmed run is checked at every step whatever its length, the window never."""
    from auditor.capture.numerics.schedule import checked

    got = [i for i in range(20_000) if checked(i, frozenset(), False)]
    gaps = [b - a for a, b in zip(got, got[1:])]
    assert got[:25] == list(range(25))  # (24 dense, then step 24 opens the one-in-32)
    assert gaps[24:40] == [32] * 16 and got[40] == 536
    assert gaps[40:56] == [64] * 16 and got[56] == 1560
    assert set(gaps[56:]) == {128}
    assert len(got) == 56 + (20_000 - 1560 + 127) // 128  # (a 20,000-step run: 201 checked steps, not 649)
    assert all(checked(i, frozenset(), True) for i in range(5_000, 5_010))
    assert not checked(1560, frozenset({1560}), True)


TINY_CALLS = '''import torch

w = torch.nn.Parameter(torch.randn(8))
opt = torch.optim.SGD([w], lr=1e-3)


def step():
    x = w
    for _ in range(300):  # 900 tiny calls: each checked costs several times its own time
        x = torch.tanh(x * 1.001 + 0.01)
    loss = x.pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
'''
WIDE_LAYERS = '''import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
x = torch.randn(512, 256)


def step():
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
'''
STEPS_SPACED = 200


def _intervals(steps: list[dict]) -> dict[int, float]:
    """Each step's interval on the program's clock: its start to the next step's (ms)."""
    return {a["index"]: (b["start_s"] - a["start_s"]) * 1e3 for a, b in zip(steps, steps[1:])}


@pytest.mark.slow
def test_checks_that_cost_steps_are_spaced_to_stay_within_their_budget(tmp_path_factory):
    """900 tiny calls a step: a checked step costs more than a step over the unchecked ones. Its
    cost, measured at steps 56 and 88 (the first checks past the dense start with unchecked steps
    to compare; the lesser of two, so that one interval lifted by another process's load spaces
    nothing; from 120 on, the least of the last three), puts the next check
    that many steps / 2% later (schedule.Spacing), on the schedule's own one-in-32 grid: the checks
    cost the run's steady state 2%, not the 4-8% that one in 32 would. The cost the event states
    is the evidence's own: each checked step's interval over the median interval of the 31
    unchecked steps before it; and the summary says so.
    Quiet, that is at 88. Where another process's load falls between the unchecked steps and a
    check, the unchecked median is the loaded one and the check reads cheaper than it is (a CI run
    read 0.3 steps at 56: 21 ms over a 16 ms median that was 8 ms after): the spacing then waits
    for the checks after it, and no check before the spacing may have read over the budget."""
    from auditor.capture.numerics.schedule import CHECK_EVERY, CHECKS_BUDGET, COSTS_KEPT, spacing

    a = _audit(tmp_path_factory, "tiny_calls", TINY_CALLS, "--steps", str(STEPS_SPACED), "--no-profile")
    assert a.returncode == 0, a.stderr[-2000:]
    steps = a.evidence["steps"]
    checked = [s["index"] for s in steps if s["numerics"] is not None]
    # (an event rides on the next checked step's record, the last on the run's final record)
    events = [e for s in steps if s["numerics"] for e in s["numerics"]["events"]] + a.evidence["numerics"]["events"]
    spaced = [e for e in events if e["event"] == "checks-spaced"]
    assert spaced and spaced[0]["step"] in range(88, STEPS_SPACED, CHECK_EVERY) and spaced[0]["budget"] == CHECKS_BUDGET, spaced
    first = spaced[0]
    at = first["step"]
    intervals = _intervals(steps)

    def cost(k: int) -> float:
        base = statistics.median(intervals[i] for i in range(k - 31, k))
        return (intervals[k] - base) / base

    def kept(k: int) -> list[float]:  # the costs Spacing holds after the check at k
        return [cost(j) for j in range(max(56, k - (COSTS_KEPT - 1) * CHECK_EVERY), k + 1, CHECK_EVERY)]

    # no earlier check left the spacing undone while every cost it held was clearly over the budget
    # (the collector's clock and the records' disagree by up to 0.24 steps under load: see below)
    for k in range(88, at, CHECK_EVERY):
        assert min(kept(k)) <= CHECK_EVERY * CHECKS_BUDGET + 0.3, (k, kept(k), spaced)
    costs = kept(at)
    measured = min(costs)
    # (the records' step starts are taken after the collectors' step_begin, the collector's own clock
    # reads inside it: under the suite's load the two disagreed by 0.24 of 1.94 steps once)
    assert first["cost_steps"] == pytest.approx(measured, abs=max(0.15, 0.15 * measured)), (first, costs)
    assert first["cost_steps"] > CHECK_EVERY * CHECKS_BUDGET  # (dearer than one in 32 allows)
    # (the event's cost is rounded to 3 decimals: the spacing is that of the cost it rounds)
    assert spacing(first["cost_steps"] - 5e-4) <= first["not_before"] - at <= spacing(first["cost_steps"] + 5e-4)
    # the next check: the schedule's first step from not_before on (none in the run where a loaded
    # machine measured the check dearer still)
    nxt = next(i for i in range(first["not_before"], 10_000) if (i - 24) % CHECK_EVERY == 0)
    grid = [*range(25), *range(56, at + 1, CHECK_EVERY)]
    assert checked[:len(grid) + 1] == [*grid, *([nxt] if nxt < STEPS_SPACED else [])], checked
    # the checks' share past their spacing, by the evidence's own intervals: within the budget
    # (a check's cost over the steps from it to the next)
    assert measured / (nxt - at) <= CHECKS_BUDGET * 1.5
    cost = a.findings_doc["steps"]["own_cost"]
    last = spaced[-1]
    assert cost["check_cost_steps"] == last["cost_steps"] and cost["check_spacing"] == last["not_before"] - last["step"]
    summary = (a.out / "summary.txt").read_text()
    assert (f"a check cost {last['cost_steps']:.2f} step(s), so they ran at least {last['not_before'] - last['step']} "
            "steps apart past the first steps, to cost under 2% of the run") in summary, summary


@pytest.mark.slow
def test_checks_that_cost_little_keep_the_schedule(tmp_path_factory):
    """Two wide layers on a batch of 512: a checked step costs a few percent of a step, within
    what one check in 32 allows, so the schedule stands (24, 56, 88, 120) and nothing is said."""
    a = _audit(tmp_path_factory, "wide_layers", WIDE_LAYERS, "--steps", "130", "--no-profile")
    assert a.returncode == 0, a.stderr[-2000:]
    steps = a.evidence["steps"]
    assert [s["index"] for s in steps if s["numerics"] is not None] == [*range(25), 56, 88, 120]
    assert not [e for s in steps if s["numerics"] for e in s["numerics"]["events"] if e["event"] == "checks-spaced"]
    assert a.findings_doc["steps"]["own_cost"]["check_spacing"] is None
    assert "steps apart past the first steps" not in (a.out / "summary.txt").read_text()


def test_spacing_reads_checked_intervals_against_the_unchecked_median():
    """schedule.Spacing on a clock the test drives: unchecked steps of 10 ms, a checked step of
    40 ms (3 steps over) -> the next check waits 150 steps; the dense start's checks and the
    intervals that touch the profiler's window are not read; one checked step's cost alone spaces
    nothing (56), two space by the lesser (88), then the least of the last three checked steps'
    (load only lengthens an interval: a 99-step interval moves nothing), and the spacing is at most MAX_SPACING."""
    from auditor.capture.numerics.schedule import MAX_SPACING, Spacing, checked, spacing

    sp, now, window, dense = Spacing(), 0.0, frozenset({40, 41}), 24
    plan = {i: 40.0 for i in (10, 56, 88, 200, 210)} | {40: 99.0, 41: 99.0} | {220: 1000.0}
    reads = {}
    for i in range(230):
        if sp.ended(i, now, window, dense):
            reads[i - 1] = (round(sp.cost_steps, 6), sp.not_before)
        sp.began(i, i in plan, now)
        now += plan.get(i, 10.0) / 1e3
    # (10: dense; 56: 3 steps over; 88: 3; 200, 210: 3; 220: 99, the least of the last three stays 3)
    assert reads == {88: (3.0, 238), 200: (3.0, 350), 210: (3.0, 360), 220: (3.0, 370)}
    assert spacing(3.0) == 150 and spacing(0.0) == 1 and spacing(1e6) == MAX_SPACING
    assert not checked(300, frozenset(), False, 24, 360) and checked(376, frozenset(), False, 24, 360)
    assert checked(300, frozenset(), True, 24, 360)  # (an alarmed run: every step)
