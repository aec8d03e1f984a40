"""step-slowdown on recorded runs of a loaded machine (no trend: the rule stays silent) and on a real
growing step (a trend: the cost it states is no more than the step times show)."""
from __future__ import annotations

import json
import re
from statistics import fmean, median

import pytest

from conftest import ROOT, audit, growing_run, printed_figures

from auditor.rules._support.trends import quarter_floors, quarter_medians, spearman, theil_sen, trend_ratio, without_spikes

DATA = ROOT / "tests" / "data"
SKIP, MIN_STEPS, MIN_RATIO, MIN_CORRELATION = 2, 12, 1.3, 0.6  # the rule's defaults


def used_steps(evidence: dict) -> list[dict]:
    """The steps the rule judges: unprofiled, past warm-up, isolated spikes left out."""
    steps = [s for s in evidence["steps"] if not s["profiled"] and s["index"] >= SKIP]
    return [steps[i] for i in without_spikes([s["ms"] for s in steps])]


def test_times_that_wander_with_load_are_not_a_slowdown(tmp_path):
    """A CUDA trainer rehearsed on a 2-core machine shared with other jobs (2 intra-op threads):
    its wall and CPU times climbed x3-x8 mid-run and came back down at the end. The CPU time
    followed the wall time (threads waiting for a descheduled peer spin and bill CPU time), so
    the CPU-time guard passed; the fastest late steps were no slower than the early ones."""
    run = DATA / "slowdown-wandering-load"
    steps = used_steps(json.loads((run / "evidence.json").read_text()))
    xs = [float(s["index"]) for s in steps]
    wall, cpu = [s["ms"] for s in steps], [s["cpu_ms"] for s in steps]
    # the gates the rule had all pass on this run: the case is exercised
    c_first, c_last = quarter_medians(cpu)
    assert len(steps) >= MIN_STEPS and trend_ratio(xs, wall) >= MIN_RATIO
    assert c_last / c_first >= MIN_RATIO and spearman(xs, cpu) >= MIN_CORRELATION
    assert trend_ratio(xs, cpu) >= MIN_RATIO
    # what tells load from growing work: the last quarter's fastest step
    f_first, f_last = quarter_floors(wall)
    assert f_last / f_first < MIN_RATIO
    a = audit("analyze", str(run), "--select", "step-slowdown", out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    assert a.rule("step-slowdown") == []


def test_min_steps_counts_the_steps_left_after_the_spikes(tmp_path):
    """A 20-step run under load: 12 unprofiled steps past warm-up, of which spike removal keeps 9;
    a trend in quarters of 2 steps is not judged (min-steps 12)."""
    run = DATA / "slowdown-spikes-under-load"
    evidence = json.loads((run / "evidence.json").read_text())
    before = [s for s in evidence["steps"] if not s["profiled"] and s["index"] >= SKIP]
    assert len(before) >= MIN_STEPS > len(used_steps(evidence))
    a = audit("analyze", str(run), "--select", "step-slowdown", out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    assert a.rule("step-slowdown") == []


def test_the_cost_of_a_slowdown_is_no_more_than_the_steps_show(tmp_path_factory):
    """The cost is the late steps' extra time over the early ones' as measured (the quarters'
    medians; their fastest steps when load lifted the first quarter's median above the last's),
    not the trend line's rise over the whole span, which exceeds it. On a CPU run it is measured
    on the process's own CPU time, in wall time at the run's wall time per CPU ms: load that came
    in bursts had lifted one loaded run's wall rise to 427 ms and another's to 47 ms (the example
    step_slowdown.py, 30 steps beside two busy loops)."""
    a = growing_run(tmp_path_factory)  # (GROWING, 18 steps: the session's one run of it)
    assert a.returncode == 0, a.stderr
    [f] = a.rule("step-slowdown")
    steps = used_steps(a.evidence)
    cpu = [s["cpu_ms"] for s in steps]
    (first, last), (f_first, f_last) = quarter_medians(cpu), quarter_floors(cpu)
    ev = f["evidence"]
    assert 0 < ev["cpu_rise_ms"] <= (last - first if last > first else f_last - f_first) + 1e-3
    per_cpu_ms = median(s["ms"] / s["cpu_ms"] for s in steps)
    assert ev["wall_per_cpu_ms"] == round(per_cpu_ms, 3)
    assert ev["rise_ms"] == pytest.approx(ev["cpu_rise_ms"] * per_cpu_ms, rel=1e-3)
    # the cost is what the run's steps took above the first quarter's level, on average: what a fix
    # saves of this run (about half the end's rise for a steady rise), never more than the rise
    saved = min(ev["rise_ms"], max(0.0, fmean(cpu) - first) * per_cpu_ms)
    assert f["cost"]["ms_per_step"] == pytest.approx(saved, rel=1e-3, abs=1e-3)
    assert 0 < f["cost"]["ms_per_step"] < ev["rise_ms"] and f["cost"]["share_of_step"] <= 1.0
    # (the rule's rise and wall-per-CPU factor are of the unrounded timings)
    rise, cpu_rise, per_cpu = printed_figures(r"the last steps took ([\d.]+) ms more than the first \(([\d.]+) ms more "
                                              r"CPU time, at this run's ([\d.]+) ms of wall time per ms of CPU time\)",
                                              f["message"])
    assert rise == pytest.approx(ev["rise_ms"], abs=0.006)
    assert cpu_rise == pytest.approx(ev["cpu_rise_ms"], abs=0.006)
    assert per_cpu == pytest.approx(per_cpu_ms, abs=0.006)


def printed_ms(message: str) -> tuple[float, float]:
    """(the step's rise, the growing call's share of it) as the message prints them."""
    rise = float(re.search(r"the last steps took ([\d.]+) ms more than the first", message)[1])
    part = re.search(r"grew the most: (?:all of those ([\d.]+)|([\d.]+) ms of those ([\d.]+)) ms", message)
    assert part, message
    if part[1]:
        return rise, float(part[1])
    assert float(part[3]) == rise, message
    return rise, float(part[2])


def test_the_growing_call_is_measured_as_the_steps_rise(tmp_path):
    """A real run of a step that registers a hook on every parameter every step (recorded before
    the hook probes existed): the message said the backward 'grew the most (+4.1 ms)' beside a
    stated rise of 3.75 ms a step, the backward's quarter medians against the step's robust rise.
    Both are now one measure, and the call's growth is no more than the step's rise it is part of."""
    run = DATA / "slowdown-piled-hooks"
    a = audit("analyze", str(run), "--select", "step-slowdown", out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    [f] = a.rule("step-slowdown")
    steps = used_steps(json.loads((run / "evidence.json").read_text()))
    xs = [float(s["index"]) for s in steps]
    backward = [sum(t["ms"] for t in s["tallies"] if t["kind"] == "backward") for s in steps]
    first, last = quarter_medians(backward)
    growth = max(0.0, min(theil_sen(xs, backward) * (xs[-1] - xs[0]), last - first))
    phase = f["evidence"]["growing_phase"]
    assert phase["what"] == "Tensor.backward" and phase["growth_ms"] == round(growth, 3), phase
    rise, part = printed_ms(f["message"])
    assert rise == round(f["evidence"]["rise_ms"], 2) and part <= rise, f["message"]
    assert part == round(min(growth, f["evidence"]["rise_ms"]), 2)
    assert [(loc["file"], loc["line"]) for loc in f["locations"]] == [("t12_hooks_bug.py", 26)]


PILING_HOOKS = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(100)])
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(8, 8), torch.randn(8, 8)


def step(i):
    for p in model.parameters():
        p.register_hook(lambda g: (g / g.norm().clamp(min=1.0)).clamp(-0.5, 0.5))  # HOOK LINE
    h = model(x)
    h.register_hook(lambda g: g * 0.5)  # ACTIVATION LINE: a new tensor each step, one hook
    loss = nn.functional.mse_loss(h, y)
    opt.zero_grad()
    loss.backward()  # BACKWARD LINE
    opt.step()
"""


def line_of(source: str, marker: str) -> int:
    return next(n for n, text in enumerate(source.splitlines(), 1) if marker in text)


def test_hooks_that_pile_up_are_counted_and_reported_as_a_leak(tmp_path):
    """`p.register_hook` in the step adds a hook to each of 200 parameters every step. The probes
    count the registrations per line and the hooks each tensor then holds: hook-leak reports the
    line with its numbers. The hook on the step's activation, one per new tensor, is counted and
    not flagged. (Whether the steps' rise clears step-slowdown's bar in one run depends on the
    machine's load, so the rule's naming of this line is asserted on a recorded run of this very
    program, below.)"""
    trainer = tmp_path / "piling.py"
    trainer.write_text(PILING_HOOKS)
    a = audit("run", f"{trainer}:step", "--steps", "30", "--no-profile", "--no-numerics", "--quiet",
              "--select", "hook-leak", out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    hook, act = line_of(PILING_HOOKS, "# HOOK LINE"), line_of(PILING_HOOKS, "# ACTIVATION LINE")
    [leak] = a.rule("hook-leak")
    assert [(loc["file"], loc["line"]) for loc in leak["locations"]] == [(str(trainer), hook)]
    ev = leak["evidence"]
    assert (ev["what"], ev["steps"], ev["calls_per_step"], ev["holders"]) == ("Tensor.register_hook", 30, 200, 200)
    assert ev["held_first"] == {"step": 0, "hooks": 1} and ev["held_last"] == {"step": 29, "hooks": 30}
    assert ("Tensor.register_hook at piling.py:%d runs in 30 steps (200 calls a step, on 200 tensors) and the "
            "hooks pile up: a tensor held 1 hook after step 0 and 30 after step 29 (+1 a step)" % hook) in leak["message"]
    activation = [t for s in a.evidence["steps"] for t in s["tallies"] if t["kind"] == "hook" and t["where"]["line"] == act]
    assert len(activation) == 30 and all(t["count"] == 1 and t["data"]["held"] == 1 for t in activation)


def test_hooks_that_pile_up_are_named_as_the_slowdowns_cause(tmp_path):
    """A recorded run of PILING_HOOKS (`audit run piling.py:step --steps 30 --no-profile
    --no-numerics` on a quiet 2-core VM; paths made relative): step-slowdown was located at
    loss.backward(), where the time grows, and the cause went unnamed. It now names the hook's line
    first (with the backward's line), and says what piles up. A live run's verdict depends on the
    load: the CPU time's quarter ratio of this program read x1.7-4.8 under a second audit's load,
    and where the load rose with the steps the rule asks x2.6 (it failed a CI run so)."""
    run = DATA / "slowdown-piling-hooks"
    recorded = json.loads((run / "evidence.json").read_text())
    assert recorded["target"] == "piling.py:step" and recorded["sources"]  # the program above, as recorded
    hook, backward = line_of(PILING_HOOKS, "# HOOK LINE"), line_of(PILING_HOOKS, "# BACKWARD LINE")
    a = audit("analyze", str(run), "--select", "step-slowdown,hook-leak", out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    [leak] = a.rule("hook-leak")
    assert [(loc["file"], loc["line"]) for loc in leak["locations"]] == [("piling.py", hook)]
    [f] = a.rule("step-slowdown")
    lines = [(loc["file"], loc["line"]) for loc in f["locations"]]
    # the hook's line first; the time that grew runs in the hooks' lambdas (that same line, as the
    # line sampler sees it) and in the backward pass that calls them
    assert lines[0] == ("piling.py", hook), lines
    assert set(lines) <= {("piling.py", hook), ("piling.py", backward)}, lines
    assert (f"Hooks pile up at piling.py:{hook}: Tensor.register_hook adds them to the same 200 tensors every step "
            "(1 each after step 0, 30 after step 29)") in f["message"], f["message"]
    assert f["evidence"]["piling_hooks"] == [{"what": "Tensor.register_hook", "line": hook, "holders": 200,
                                              "held_first": 1, "held_last": 30}]
    rise, part = printed_ms(f["message"])
    assert rise == round(f["evidence"]["rise_ms"], 2) and part <= rise


def test_hooks_registered_once_pile_nothing_up(tmp_path):
    """The twin that registers the parameters' hooks once, at setup: nothing piles up, no finding."""
    source = PILING_HOOKS.replace("def step(i):\n    for p in model.parameters():\n        p.register_hook",
                                  "for p in model.parameters():\n    p.register_hook").replace(
        "# HOOK LINE\n", "# HOOK LINE\n\n\ndef step(i):\n")
    assert "\ndef step(i):\n    h = model(x)" in source
    trainer = tmp_path / "once.py"
    trainer.write_text(source)
    a = audit("run", f"{trainer}:step", "--steps", "30", "--no-profile", "--quiet", out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    assert a.rule("hook-leak") == []
    assert a.rule("step-slowdown") == []  # (judged on this one run)
    setup = [t for t in a.evidence["setup"] if t["kind"] == "hook"]
    assert [(t["where"]["line"], t["count"], t["data"]["held"]) for t in setup] == [
        (line_of(source, "# HOOK LINE"), 200, 1)]


def test_the_trend_fit_of_a_long_run_takes_bounded_time():
    """theil_sen took every pair of points: 20,000 steps were 200 million slopes (205 s, 9.8 GB).
    Beyond EXACT_POINTS it takes a fixed-seed sample of pairs: within a second here, close to the
    true slope; below, every pair as before (the same value as the pairwise median)."""
    import random
    import time
    from statistics import median

    from auditor.rules._support.trends import EXACT_POINTS

    r = random.Random(0)
    xs = [float(i) for i in range(20000)]
    ys = [1.0 + 0.001 * i + r.random() for i in xs]
    t0 = time.perf_counter()
    slope = theil_sen(xs, ys)
    assert time.perf_counter() - t0 < 5 and abs(slope - 0.001) < 2e-5
    small_x, small_y = xs[:300:3] + [5.0], ys[:300:3] + [9.0]  # (a repeated x is left out, as before)
    pairwise = median((small_y[j] - small_y[i]) / (small_x[j] - small_x[i]) for i in range(len(small_x))
                      for j in range(i + 1, len(small_x)) if small_x[j] != small_x[i])
    assert theil_sen(small_x, small_y) == pairwise and len(small_x) < EXACT_POINTS
