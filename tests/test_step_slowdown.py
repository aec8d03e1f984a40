"""step-slowdown on recorded runs of a loaded machine (no trend: the rule stays silent) and on a real
growing step (a trend: the cost it states is no more than the step times show)."""
from __future__ import annotations

import json
from pathlib import Path

from conftest import GROWING, audit

from auditor.rules.common import quarter_floors, quarter_medians, spearman, trend_ratio, without_spikes

DATA = Path(__file__).parent / "data"
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


def test_the_cost_of_a_slowdown_is_no_more_than_the_steps_show(tmp_path):
    """The cost is the late steps' extra time over the early ones' as measured (the quarters'
    medians; their fastest steps when load lifted the first quarter's median above the last's),
    not the trend line's rise over the whole span, which exceeds it."""
    trainer = tmp_path / "growing.py"
    trainer.write_text(GROWING)
    a = audit("run", f"{trainer}:step", "--steps", "18", "--no-profile", "--no-numerics", "--quiet",
              out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    [f] = a.rule("step-slowdown")
    wall = [s["ms"] for s in used_steps(a.evidence)]
    (first, last), (f_first, f_last) = quarter_medians(wall), quarter_floors(wall)
    cost = f["cost"]["ms_per_step"]
    assert 0 < cost <= (last - first if last > first else f_last - f_first) + 1e-3
    assert cost < last
