"""How sure a verdict that depends on timing is: one vocabulary for every such finding.

Each timing verdict states its confidence the same way: `evidence.confidence` ("high", "medium" or
"low"), the spread it was judged on (quartiles of a per-step series), `steps_timed`, and
`cpu_over_wall` (the steps' median process CPU time over their wall time: below 1, other load kept
the process off the cores and stretched every timing alike), and the message ends with one sentence
"Confidence: LEVEL (why)." Fractions are written as fractions: a finding's one percentage is its
cost's share of the step.
"""
from __future__ import annotations

from collections.abc import Sequence
from statistics import median
from typing import Any

from auditor.evidence import model as m

LOADED = 0.8  # CPU time under this share of wall time: the message says other load stretched the timings
LEVELS = ("low", "medium", "high")


def quartiles(xs: Sequence[float]) -> tuple[float, float, float]:
    """Lower quartile, median and upper quartile of `xs` (its middle half lies between the first
    and the last); (0, 0, 0) for none."""
    s = sorted(xs)
    n = len(s)
    if not n:
        return 0.0, 0.0, 0.0
    return s[n // 4], median(s), s[min(n - 1, (3 * n) // 4)]


def cpu_over_wall(steps: Sequence[m.StepRecord]) -> float | None:
    """The steps' median process CPU time over their wall time (None: no step has its CPU time)."""
    ratios = [s.cpu_ms / s.ms for s in steps if s.ms and s.cpu_ms is not None]
    return round(median(ratios), 3) if ratios else None


def load_clause(ratio: float | None) -> str:
    """The sentence part that says other load stretched the timings, when the CPU ratio shows it."""
    if ratio is None or ratio >= LOADED:
        return ""
    return f"; the process had the CPU {ratio:.2f} of its wall time, so other load stretched the timings"


def stated(level: str, reasons: str, ratio: float | None, **evidence: Any) -> tuple[dict[str, Any], str]:
    """The evidence keys (`confidence`, `cpu_over_wall` and the rule's own spread keys) and the
    message's sentence "Confidence: LEVEL (reasons[; load])."."""
    return ({"confidence": level, **evidence, "cpu_over_wall": ratio},
            f"Confidence: {level} ({reasons}{load_clause(ratio)}).")


def share_confidence(shares: Sequence[float], threshold: float, cpu_ratio: Sequence[float]) -> tuple[dict[str, Any], str]:
    """A verdict on a share of the step (dataloader-bound's wait over the step): how sure it is,
    from the spread of each step's own share (its wait over its wall time): "high" when at least 80%
    of the steps wait `threshold` or more and the median step's share is 1.25x it or more, "low"
    when fewer than 60% do, the median is within 10% of it or fewer than 4 steps were timed (as for
    cost_confidence), else "medium"."""
    xs = sorted(shares)
    n = len(xs)
    if not n:
        return {"confidence": "low"}, "Confidence: low (no step timed)."
    q1, q2, q3 = quartiles(xs)
    over = sum(x >= threshold for x in xs)
    level = ("low" if n < 4 or over < 0.6 * n or q2 < 1.1 * threshold else
             "high" if over >= 0.8 * n and q2 >= 1.25 * threshold else "medium")
    ratio = round(median(cpu_ratio), 3) if cpu_ratio else None
    return stated(level, f"{over} of {n} steps waited {threshold:g} of their time or more; the middle half of "
                         f"the steps, {q1:.2f}-{q3:.2f} of theirs", ratio,
                  step_share_quartiles=[round(q1, 4), round(q2, 4), round(q3, 4)],
                  steps_over_min_share=over, steps_timed=n)


def cost_confidence(per_step_ms: Sequence[float], ratio: float | None, what: str) -> tuple[dict[str, Any], str]:
    """A measured cost whose verdict does not depend on timing (a call counted every step): how
    firm its number is, from the spread of its time in the steps that have it. "high" when the
    middle half of those steps lies within 25% of their median, "low" when it spans more than the
    median itself (or fewer than 4 steps were timed), else "medium"."""
    xs = list(per_step_ms)
    n = len(xs)
    if not n:
        return {"confidence": "low", "steps_timed": 0}, "Confidence: low (no call timed)."
    q1, q2, q3 = quartiles(xs)
    spread = (q3 - q1) / q2 if q2 > 0 else float("inf")
    level = "low" if n < 4 or spread > 1.0 else "high" if spread <= 0.5 else "medium"
    q1, q2, q3 = round(q1, 3), round(q2, 3), round(q3, 3)  # the sentence states the evidence's figures
    return stated(level, f"{what} took {q1:.2f}-{q3:.2f} ms in the middle half of the {n} steps that made the calls, "
                         f"median {q2:.2f} ms", ratio,
                  cost_ms_quartiles=[q1, q2, q3], steps_timed=n)


def trend_confidence(ys: Sequence[float], fitted: Sequence[float], rise: float, min_ratio: float,
                     ratio: float, basis: str, cpu: float | None) -> tuple[dict[str, Any], str]:
    """A verdict on a trend (step-slowdown): how sure it is, from the early and late windows (the
    first and last quarter of the steps, `ys` in the series the verdict was judged on, `basis`) and
    the steps' scatter about the trend line (`fitted`). "high" when the middle halves of the two
    windows do not overlap, the rise is 3 times the scatter (the median absolute residual, scaled to
    a standard deviation) or more and `ratio` (late over early) is 1.25x `min_ratio` or more; "low"
    when the windows' middle halves overlap or the rise is under 1.5 times the scatter; else
    "medium"."""
    n = len(ys)
    q = max(1, n // 4)
    early, late = quartiles(ys[:q]), quartiles(ys[-q:])
    scatter = 1.4826 * median([abs(y - f) for y, f in zip(ys, fitted)]) if n else 0.0
    over_noise = rise / scatter if scatter > 0 else float("inf")
    apart = late[0] > early[2]
    level = ("high" if apart and over_noise >= 3 and ratio >= 1.25 * min_ratio else
             "low" if not apart or over_noise < 1.5 else "medium")
    reasons = (f"the middle half of the first {q} steps took {early[0]:.1f}-{early[2]:.1f} ms of {basis} time, "
               f"of the last {q} {late[0]:.1f}-{late[2]:.1f} ms" + ("" if apart else ", overlapping"))
    reasons += (f"; the rise is {over_noise:.1f}x the steps' scatter about the trend line" if scatter > 0 else
                "; the steps lie on the trend line")
    return stated(level, reasons, cpu,
                  judged_on=basis, early_quartiles_ms=[round(x, 3) for x in early],
                  late_quartiles_ms=[round(x, 3) for x in late],
                  rise_over_scatter=round(over_noise, 2) if scatter > 0 else None, steps_timed=n)
