"""Load that another process brings onto the step's core, measured per step (the thread's run delay,
Linux's schedstat), and step-slowdown's use of it: a rise that came with such load must be twice
as large (load-slowdown) to be judged the program's.

The program pins itself to one core and, at step 12, starts two busy processes on the same core; its own
work also grows each step, a little (x1.8 over the run) or a lot (x3.7). On a CI machine a test
worker's load rose mid-run in the same way: the CPU time of a DataLoader example's constant steps
rose x1.48 (shared caches, an SMT sibling) and step-slowdown reported a slowdown that was the load's."""
from __future__ import annotations

import os
from statistics import median

import pytest

from conftest import audit

from auditor.rules._support.trends import quarter_medians

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat") or not hasattr(os, "sched_setaffinity"),
                                reason="the kernel keeps no run delays here")

HOG_AT = 12
PROGRAM = f"""import os, subprocess, sys, time

core = min(os.sched_getaffinity(0))
os.sched_setaffinity(0, {{core}})  # this process, and from step {HOG_AT} two others, on one core
hog = None


def step(i):
    global hog
    if i == {HOG_AT}:  # two busy processes: the step's share of its core falls to a third or less
        hog = [subprocess.Popen([sys.executable, "-c", f"import os\\nos.sched_setaffinity(0, {{{{{{core}}}}}})\\nwhile True: pass"])
               for _ in range(2)]
    t = time.process_time()
    while time.process_time() - t < 0.004 + {{growth}} * i:  # the program's own work, growing
        pass
    if i == 29:
        for h in hog:
            h.kill()
            h.wait()
"""


def run(tmp_path_factory, growth: float):
    tmp = tmp_path_factory.mktemp("loaded")
    (tmp / "loaded.py").write_text(PROGRAM.replace("{growth}", str(growth)))
    a = audit("run", f"{tmp / 'loaded.py'}:step", "--steps", "30", "--no-profile", "--quiet", out=tmp / "out")
    assert a.returncode == 0, a.stderr
    return a


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """A little more work each step: x1.8 from the first quarter to the last."""
    return run(tmp_path_factory, 0.0002)


@pytest.fixture(scope="module")
def loaded_growing(tmp_path_factory):
    """Much more work each step: x3.7 from the first quarter to the last."""
    return run(tmp_path_factory, 0.0015)


def test_each_step_records_how_long_its_thread_waited_for_the_cpu(loaded):
    """A busy thread that never sleeps is, at every moment of its step, either running or waiting
    to run: its wall time is its own CPU time plus its run delay. (The process's CPU time, which
    the step records, also holds the audit's other threads': the wall time less it is at most the
    run delay. And the delay is counted from the previous step's end: it may hold the boundary
    before the step too, never more.) With two busy processes on its core it waits for about two
    thirds of each step. A thread blocked, not runnable, is neither: waiting for the GIL while one
    of the audit's own threads (the line sampler, the memory sampler) holds it and itself waits
    for the core, the likely case on CI, with the suite's other worker (one step of 28 read 29.98
    ms, 8.23 of CPU and 17.99 waited). The lower bound may miss in at most one step in ten; the
    upper bound holds in every step."""
    steps = loaded.evidence["steps"]
    short = []
    for before, s in zip(steps, steps[1:]):
        if s["index"] in (HOG_AT, 29):  # (these also wait for the busy processes to start, or end)
            continue
        since_ms = (s["start_s"] - before["start_s"]) * 1e3 + s["ms"] - before["ms"]  # (its end less the last's)
        assert s["waited_ms"] is not None
        assert s["waited_ms"] <= since_ms + 0.5, s
        if s["ms"] - s["cpu_ms"] - 0.5 > s["waited_ms"]:
            short.append(s)
    assert len(short) <= (len(steps) - 3) // 10, short
    steps = [s for s in steps if s["index"] >= 2]
    after = [s["waited_ms"] / s["ms"] for s in steps if s["index"] > HOG_AT]
    assert median(after) >= 0.5


def test_a_small_rise_that_came_with_load_is_not_judged(loaded):
    """The run's own CPU time rose x1.8 and its wall time more, so every gate of step-slowdown at its
    min-ratio (1.3) passes; but its thread waited for the CPU for a larger share of the last steps
    than of the first (the busy processes), so the rise must be x2.6, and the rule says nothing.
    Read without the run delays (a kernel that keeps none), the same evidence is reported as a
    slowdown: the load measure is what keeps it silent."""
    from auditor.evidence.load import load_paths
    from auditor.rules.step_slowdown import StepSlowdown

    ev = load_paths([loaded.out])
    steps = [s for s in ev.steps if s.index >= 2 and not s.profiled]
    first, last = quarter_medians([s.waited_ms / s.ms for s in steps])
    assert last - first > 0.1, (first, last)  # (the rule's max-load-rise)
    assert loaded.rule("step-slowdown") == []
    rule = StepSlowdown()
    options = rule.default_options()
    assert list(rule.check(ev, options)) == []
    for s in ev.steps:
        s.waited_ms = None
    [f] = rule.check(ev, options)
    assert 1.3 <= f.evidence["cpu_ratio"] < 2.6 and f.evidence["waited_share_first_quarter"] is None
    assert f.evidence["load_rose"] is False and f.evidence["ratio_needed"] == 1.3


def test_a_large_rise_that_came_with_load_is_still_reported(loaded_growing):
    """The same load, and work that grows x3.7: more than such load makes of constant work, so the
    slowdown is reported, with the load it was judged under."""
    [f] = loaded_growing.rule("step-slowdown")
    ev = f["evidence"]
    assert ev["load_rose"] is True and ev["ratio_needed"] == 2.6 and ev["cpu_ratio"] >= 2.6
    assert ev["waited_share_last_quarter"] - ev["waited_share_first_quarter"] > 0.1
