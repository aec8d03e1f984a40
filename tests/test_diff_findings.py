"""auditor.diff: findings of two audits paired by rule and place, and the regression line."""
from __future__ import annotations

from auditor.diff import compare_findings, regression
from auditor.evidence.compare import Mean, Side, Stat, compare
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
    """The gate judges the run's time per step where both sides have it (the median step beside it
    moves the other way here), the median step where one has none, and says which."""
    a = Side("a", "run", steps=40, step_ms=Stat(100.0, 1.0), run_ms=Mean(130.0, 2.0, 40), run_steps=40)
    b = Side("b", "run", steps=40, step_ms=Stat(112.0, 1.0), run_ms=Mean(120.0, 2.0, 40), run_steps=40)
    c = compare(a, b)
    assert c.judged_by == "run's time per step" and c.step_pct == 12.0 and round(c.run_pct, 2) == -7.69
    assert regression(c, 5.0) is None  # (the median step is 12% slower, the run's time 7.7% faster)
    back = compare(b, a)
    assert regression(back, 10.0) is None
    assert regression(back, 5.0) == ("audit: regression: run's time 120.00 ms/step -> 130.00 ms/step (+8.3%, "
                                     "noise ±2.83 ms), more than --fail-on-regression 5%")
    old = compare(Side("a", "trace", steps=0, step_ms=Stat(100.0, 1.0)), b)  # (a recording without steps)
    assert old.judged_by == "median step" and old.run_pct is None
    assert regression(old, 15.0) is None
    assert regression(old, 10.0) == ("audit: regression: median step (no run's time on both sides) 100.00 ms -> "
                                     "112.00 ms (+12.0%, noise ±1.41 ms), more than --fail-on-regression 10%")
    # the terminal's and the report's headline: the judged figure first, the median step beside it
    from auditor.reports.diff_report import headline, judged_note

    assert headline(c) == ("run's time 130.00 ms/step (40 steps) -> 120.00 ms/step (40 steps): -10.00 ms (-7.7%), "
                           "noise ±2.83 ms: faster; median step 100.00 ms -> 112.00 ms (+12.0%)")
    assert judged_note(c) is None
    assert headline(old).startswith("median step 100.00 ms (0 steps) -> 112.00 ms (40 steps): +12.00 ms (+12.0%)")
    assert judged_note(old) == "judged by the median step: A has no run's time (a recording without steps)"
