"""auditor.diff: findings of two audits paired by rule and place, and the regression line."""
from __future__ import annotations

from auditor.diff import compare_findings, regression
from auditor.evidence.compare import Comparison, Side, Stat, delta
from auditor.findings import Cost, Finding, Location


def finding(rule: str, line: int, ms: float | None = None) -> Finding:
    return Finding(rule=rule, severity="warning", title=rule, message=f"{rule} at {line}",
                   locations=[Location(file="/x/train.py", line=line)],
                   cost=Cost(ms, None) if ms is not None else None)


def test_findings_are_gone_new_or_kept_with_their_cost_change():
    a = [finding("host-sync", 52, 5.0), finding("graph-leak", 51), finding("host-sync", 60, 1.0)]
    b = [finding("host-sync", 60, 0.5), finding("dataloader-bound", 29, 40.0), finding("host-sync", 70, 9.0)]
    out = compare_findings(a, b, noise=1.0)
    got = [(f.status, f.rule, f.where, f.verdict) for f in out]
    assert got == [("gone", "graph-leak", "train.py:51", "gone"),
                   ("new", "dataloader-bound", "train.py:29", "new"),
                   ("kept", "host-sync", "train.py:60", "within noise"),  # same place: 1.0 -> 0.5 ms
                   ("kept", "host-sync", "train.py:70", "worse")]  # paired in order: 5.0 -> 9.0 ms
    assert (out[3].cost_a, out[3].cost_b, out[3].change) == (5.0, 9.0, 4.0)
    assert out[0].message_a == "graph-leak at 51" and out[0].message_b == ""


def test_regression_line_only_above_the_threshold():
    c = Comparison(a=Side("a", "run"), b=Side("b", "run"),
                   deltas=[delta("step", "median step", "ms", Stat(100.0, 1.0), Stat(112.0, 1.0))])
    assert regression(c, 15.0) is None
    assert regression(c, 10.0) == ("audit: regression: median step 100.00 ms -> 112.00 ms (+12.0%, noise ±1.41 ms), "
                                   "more than --fail-on-regression 10%")
