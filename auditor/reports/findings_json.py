"""`findings.json`: the contract other tools read. Its keys are documented in docs/schemas.md."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from auditor import __version__
from auditor.evidence.model import Evidence
from auditor.evidence.between import between
from auditor.evidence.own_cost import own_cost
from auditor.evidence.run_time import run_time
from auditor.evidence.step_clock import step_clock
from auditor.reports.allocator_view import document_section as allocator_section
from auditor.evidence.trace.efficiency import steps_gpu
from auditor.reports.base import Reporter
from auditor.findings import RuleResults
from auditor.reports.window_drop import judged_without


def document(evidence: Evidence, results: RuleResults) -> dict[str, Any]:
    """The findings.json document as plain data (also what the HTML report embeds)."""
    per_step = [round(ms, 3) for ms in evidence.shown_step_ms()]
    median = evidence.shown_median_ms()
    check = evidence.median_check_ms()
    return {
        "tool": {"name": "auditor", "version": __version__},
        "target": evidence.target,
        "source": evidence.source,
        # the first figure: the run's time per step and its parts (auditor.evidence.run_time)
        "run_time": msgspec.to_builtins(run_time(evidence)),
        "environment": msgspec.to_builtins(evidence.environment),
        "steps": {
            "count": len(per_step),
            "requested": evidence.requested_steps,
            "per_step_ms": per_step,
            **_clocks(evidence),
            "median_ms": round(median, 3) if median is not None else None,
            "numerics_check_median_ms": round(check, 3) if check is not None else None,
            "total_ms": round(sum(per_step), 3),
            "profiled_steps": [s.index for s in evidence.steps if s.profiled],
            "own_cost": msgspec.to_builtins(own_cost(evidence)),
            "between": msgspec.to_builtins(between(evidence)),
            "gpu": steps_gpu(evidence),
        },
        "ending": msgspec.to_builtins(evidence.ending),
        "findings": msgspec.to_builtins(results.findings),
        "skipped_rules": results.skipped,
        # rules that judged a profiler window recorded without shapes or stacks (dropped to fit its bounds)
        "judged_without": judged_without(evidence, results),
        "rule_errors": [{"rule": e["rule"], "error": e["error"]} for e in results.errors],
        "suppressed": results.suppressed,
        "baseline": _baseline(evidence),
        "allocator": allocator_section(evidence),
    }


def _clocks(evidence: Evidence) -> dict[str, Any]:
    """`steps.host_ms` and `steps.device_ms` (each step on each clock; null where a step has no
    device time) and `steps.clock` (the bound and the medians: auditor.evidence.step_clock)."""
    import math

    def r(v: float | None) -> float | None:
        return None if v is None or not math.isfinite(v) else round(v, 3)

    if evidence.steps:
        host = [r(s.ms) for s in evidence.steps]
        device = [r(s.device_ms) for s in evidence.steps]
    else:
        trace = evidence.shown_trace()
        host = [r(float(v)) for v in trace.host_step_ms()] if trace is not None else []
        device = [r(float(v)) for v in trace.device_step_ms()] if trace is not None else []
    clock = step_clock(evidence)
    return {"host_ms": host, "device_ms": device,
            "clock": {k: (r(v) if isinstance(v, float) else v) for k, v in msgspec.to_builtins(clock).items()}}


def _baseline(evidence: Evidence) -> dict[str, Any] | None:
    """`audit run --baseline DIR`: the comparison with it (diff_report.baseline_summary); None without."""
    from auditor.reports.diff_report import baseline_summary

    comparison = evidence.__dict__.get("baseline")
    return baseline_summary(comparison) if comparison is not None else None


class FindingsJson(Reporter):
    name = "json"
    filename = "findings.json"

    def render(self, evidence: Evidence, results: RuleResults, out_dir: Path) -> bytes:
        return msgspec.json.format(msgspec.json.encode(document(evidence, results)), indent=2)
