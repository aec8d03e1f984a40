"""memory-growth on process memory (RSS) read over few steps, with no holder of the program's
growing, is said to be unsure (info), not a warning that predicts tens of GiB.

tests/data/rss-warmup-imagenet is the evidence of a real audit of pytorch/examples' imagenet/main.py
(`-a resnet18 --dummy -b 16 -j 2`, `--steps 20`, CUDA rehearsal on a CPU with torch 2.14.1; the
steps' tallies and numerics, the trace, the program's paths and most graph-scan holders left out):
its RSS rose 1549 -> 1788 MiB over steps 9-19, the steps after the profiler window, and the rule
said "another 1,000 steps add 23.6 GiB". The same audit over 80 steps found no growth: the RSS
stayed at 1.55-1.80 GiB from step 10 to 79 (a heap and the DataLoader workers' batches settling)."""
from __future__ import annotations

from conftest import ROOT
from auditor.evidence.load import load_paths
from auditor.rules.memory_growth import MemoryGrowth

WARMUP = ROOT / "tests" / "data" / "rss-warmup-imagenet"


def test_a_short_rss_rise_with_no_holder_is_unsure():
    ev = load_paths([WARMUP])
    assert ev.profile.steps == [3, 4, 5, 6] and len(ev.steps) == 20
    rule = MemoryGrowth()
    [f] = rule.check(ev, rule.default_options())
    assert f.severity == "info" and f.evidence["unsure"] is True
    assert f.evidence["steps_used"] == 11 and f.evidence["metric"] == "rss_bytes"
    assert "Read on 11 steps only" in f.message and "--steps 200" in f.message


def test_the_same_rise_over_enough_steps_is_a_warning():
    ev = load_paths([WARMUP])
    rule = MemoryGrowth()
    [f] = rule.check(ev, MemoryGrowth.options_with({"min-rss-steps": 11}))
    assert f.severity == "warning" and not f.evidence["unsure"]
    assert "Read on" not in f.message
