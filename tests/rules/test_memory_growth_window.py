"""memory-growth on process memory (RSS) does not read a trend across the profiler window.

tests/data/rss-window-llmc is the evidence of a real audit of llm.c's train_gpt2.py (d12, batch 2 x
64 tokens, 12 iterations on CPU; the steps' tallies and numerics, the trace and the program's
paths left out): its profiler window, steps 3-4, left ~300 MiB in the heap (2449 -> 2744 MiB), and
with 5 steps after the window (fewer than `min-steps`) the rule fell back to every unprofiled step,
across the window, and said "grew by 429 MiB (47.67 MiB per step) ... another 1,000 steps add 46.5
GiB". The same program run plainly stays at 2560-2630 MiB from its second step. Now, with too few
steps after the window, only the steps before it are judged (here too few: no trend is read);
examples/memory_growth.py, whose steps after the window are enough, is still found
(tests/rules/test_examples.py), and so is a growth the steps before a late window show."""
from __future__ import annotations

from conftest import ROOT
from auditor.evidence.load import load_paths
from auditor.rules.memory_growth import MemoryGrowth

WINDOW = ROOT / "tests" / "data" / "rss-window-llmc"


def test_the_profilers_leftover_across_its_window_is_not_growth():
    ev = load_paths([WINDOW])
    assert ev.profile.steps == [3, 4]
    rule = MemoryGrowth()
    assert list(rule.check(ev, rule.default_options())) == []


def test_growth_before_a_late_window_is_still_read():
    ev = load_paths([WINDOW])
    # the same run with its window moved to its last steps and a steady leak before it
    ev.profile.steps = [10, 11]
    for s in ev.steps:
        s.profiled = s.index in (10, 11)
        s.rss_bytes = (2400 + 40 * s.index) * 2**20
    [f] = MemoryGrowth().check(ev, MemoryGrowth().default_options())
    assert f.evidence["steps_used"] == 8 and f.evidence["mib_per_step"] == 40.0
