"""memory-growth on process memory (RSS) holds a large heap's churn to a share of its size.

tests/data/rss-churn-mingpt is the evidence of a real audit of minGPT's chargpt (projects/chargpt,
gpt-nano, batch 16, CUDA rehearsed on this CPU; its steps' tallies and the trace left out): its RSS
went from 750 to 810 MiB over the 20 steps after the profiler window, a rank correlation of 0.91,
and memory-growth said "another 1,000 steps add 3.1 GiB". The same program run plainly for 400
iterations stays at 420-440 MiB, and five more audits of it moved -22 to +42 MiB over those steps:
the audited process's heap refilling and churning, not the program's memory. Growth must now also
be `min-rss-growth-share` (10%) of the first step used's RSS; examples/memory_growth.py (2.5 MiB a
step, held by a list) is still found (tests/rules/test_examples.py), and a tensor holder's growth is
counted exactly whatever the share."""
from __future__ import annotations

from conftest import ROOT
from auditor.evidence.load import load_paths
from auditor.rules.memory_growth import MemoryGrowth

CHURN = ROOT / "tests" / "data" / "rss-churn-mingpt"


def test_rss_churn_of_a_large_heap_is_not_growth():
    ev = load_paths([CHURN])
    rule = MemoryGrowth()
    assert list(rule.check(ev, rule.default_options())) == []
    # without the share, every other gate passes on these same readings: the share keeps it silent
    [f] = rule.check(ev, MemoryGrowth.options_with({"min-rss-growth-share": 0.0}))
    assert f.evidence["metric"] == "rss_bytes"
    assert 60 <= f.evidence["growth_mib"] < 0.1 * f.evidence["start_mib"]
    assert f.evidence["spearman"] >= 0.8 and f.evidence["mib_per_step"] >= 0.25
