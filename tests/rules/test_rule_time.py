"""Each rule's time on a recorded trace, against the parse of that trace (a ratio of CPU times, so
the machine's speed and load cancel): a rule that reads the trace's file again, or decodes its
argument records again, costs about as much as the parse and fails here.

On the H100 OWLv2 recording (132,092 events, shapes and stacks recorded) the rules took 1.35x the
parse in all when cudnn-benchmark's skip_reason and the efficiency model streamed the file a second
time for the operators' shapes, and 0.31x once they read the parse's argument records (the largest
rule, unfused-attention, 0.10x)."""
from __future__ import annotations

import time

from conftest import FIXTURES

import auditor.cst_edits  # noqa: F401  (what the rules import when they build an edit)
import auditor.rules._support.sdpa_patch  # noqa: F401
from auditor.evidence.load import load_paths
from auditor.rules.engine import run_rules
from auditor.rules.registry import all_rules

OWLV2 = FIXTURES / "traces" / "h100_owlv2_syncs_dataloader.pt.trace.json.gz"
# bounds on the CPU time ratio (rule / parse): three times what was measured, for a loaded machine
PER_RULE = 0.3
ALL_RULES = 1.0


def test_no_rule_costs_a_parse_of_the_trace():
    all_rules()  # (the rules' imports, and the edits' above, are not theirs to pay for)
    started = time.process_time()
    ev = load_paths([OWLV2])
    parse = time.process_time() - started
    timings: dict[str, dict[str, float]] = {}
    results = run_rules(ev, timings=timings)
    assert not results.errors, results.errors
    ratios = {rule: t["cpu_seconds"] / parse for rule, t in timings.items()}
    shown = ", ".join(f"{r} {x:.2f}x" for r, x in sorted(ratios.items(), key=lambda kv: -kv[1])[:5])
    assert max(ratios.values()) <= PER_RULE, f"parse {parse:.2f} s CPU; rules: {shown}"
    assert sum(ratios.values()) <= ALL_RULES, f"parse {parse:.2f} s CPU; rules in all {sum(ratios.values()):.2f}x: {shown}"
    # the rules that read argument records did read them (the ratio is not met by reading nothing)
    assert {f.rule for f in results.findings} >= {"unfused-attention", "gpu-idle", "host-sync"}
