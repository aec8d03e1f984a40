"""`audit diff A B` and `audit run ... --baseline DIR`: two inputs loaded as `audit analyze` loads
them, the rules run on each, and their numbers and findings compared (auditor.evidence.compare).

An input is an `audit run` output directory, a profiler trace (.json / .json.gz) or a TensorBoard
logdir of traces. Findings are matched by rule, then by place (file name and line) within a rule,
then in order: one that only A has is "gone", one only B has is "new", one in both is "kept", its
cost change judged against the noise of the run's time per step (the median step's where a side
has no run's time).
"""
from __future__ import annotations

from pathlib import Path

from auditor.config import Config
from auditor.evidence.compare import (BETTER, GONE, NEW, RUN_TIME, WITHIN_NOISE, WORSE, Comparison, FindingChange,
                                      compare, judged, step_noise, summarize)
from auditor.evidence.errors import InputError
from auditor.evidence.model import Evidence
from auditor.findings import Finding, RuleResults


def load_side(path: Path) -> Evidence:
    """One side of a comparison, loaded as `audit analyze PATH` loads it. Raises InputError for a
    path that does not exist or that holds nothing to compare (a memory snapshot alone)."""
    from auditor.evidence.load import load_paths

    if not path.exists():
        raise InputError(f"{path}: no such file or directory")
    evidence = load_paths([path])
    if evidence.source == "run" and not [s for s in evidence.steps if not s.failed]:
        raise InputError(f"{path}: the run recorded no completed step to compare")
    if evidence.source != "run" and not evidence.trace_data:
        raise InputError(f"{path}: holds no profiler trace or run to compare (a memory snapshot alone has no steps)")
    return evidence


def run_rules_on(evidence: Evidence, config: Config) -> RuleResults:
    from auditor.rules.engine import run_rules

    return run_rules(evidence, config)


def compare_runs(a: Evidence, ra: RuleResults, label_a: str, b: Evidence, rb: RuleResults,
                 label_b: str) -> Comparison:
    """Both sides' numbers and their findings, B against A."""
    c = compare(summarize(a, label_a), summarize(b, label_b))
    c.findings = compare_findings(ra.findings, rb.findings, step_noise(c))
    return c


def compare_paths(path_a: Path, path_b: Path, config: Config) -> Comparison:
    """`audit diff A B`: load both (InputError for an unreadable one), run the rules on each, compare."""
    a = load_side(path_a)
    b = load_side(path_b)
    return compare_runs(a, run_rules_on(a, config), str(path_a), b, run_rules_on(b, config), str(path_b))


def _where(f: Finding) -> str:
    if not f.locations:
        return ""
    loc = f.locations[0]
    return f"{Path(loc.file).name}:{loc.line}"


def _cost(f: Finding | None) -> float | None:
    return f.cost.ms_per_step if f is not None and f.cost is not None else None


def _pairs(a: list[Finding], b: list[Finding]) -> list[tuple[Finding | None, Finding | None]]:
    """Findings of one rule paired: same place first, then in order; the rest unpaired."""
    rest_b = list(b)
    out: list[tuple[Finding | None, Finding | None]] = []
    unmatched_a = []
    for f in a:
        same = next((g for g in rest_b if _where(g) == _where(f)), None)
        if same is not None:
            rest_b.remove(same)
            out.append((f, same))
        else:
            unmatched_a.append(f)
    for f in unmatched_a:
        out.append((f, rest_b.pop(0) if rest_b else None))
    out.extend((None, g) for g in rest_b)
    return out


def compare_findings(a: list[Finding], b: list[Finding], noise: float) -> list[FindingChange]:
    """Each finding of either side with its status (gone / new / kept) and cost change; a kept
    finding's change within `noise` (ms per step) is "within noise". Gone first, then new, then kept."""
    rules = list(dict.fromkeys([f.rule for f in a] + [f.rule for f in b]))
    out: list[FindingChange] = []
    for rule in rules:
        for fa, fb in _pairs([f for f in a if f.rule == rule], [f for f in b if f.rule == rule]):
            f = fb or fa
            ca, cb = _cost(fa), _cost(fb)
            if fb is None:
                status, verdict, change = "gone", GONE, None
            elif fa is None:
                status, verdict, change = "new", NEW, None
            else:
                status = "kept"
                change = cb - ca if ca is not None and cb is not None else None
                verdict = ("" if change is None else WITHIN_NOISE if abs(change) <= noise
                           else BETTER if change < 0 else WORSE)
            out.append(FindingChange(rule=rule, severity=f.severity, title=f.title, status=status,
                                     where=_where(f), cost_a=ca, cost_b=cb, change=change, verdict=verdict,
                                     message_a=fa.message if fa else "", message_b=fb.message if fb else ""))
    order = {"gone": 0, "new": 1, "kept": 2}
    return sorted(out, key=lambda x: order[x.status])


def regression(c: Comparison, pct: float) -> str | None:
    """The one line `--fail-on-regression PCT` prints when B's run's time per step is slower than
    A's by more than PCT percent (their median step where a side has no run's time: the line says
    so); None when it is not (or a side has no steps)."""
    first = judged(c)
    if first is None or first.pct is None or first.pct <= pct:
        return None
    noise = f", noise ±{first.noise:.2f} ms" if first.noise is not None else ""
    what = "run's time" if c.judged_by == RUN_TIME else "median step (no run's time on both sides)"
    unit = " ms/step" if c.judged_by == RUN_TIME else " ms"
    return (f"audit: regression: {what} {first.a:.2f}{unit} -> {first.b:.2f}{unit} ({first.pct:+.1f}%{noise}), "
            f"more than --fail-on-regression {pct:g}%")
