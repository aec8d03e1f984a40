"""What the profiler window recorded without (shapes, stacks: dropped to fit its bounds, see
auditor.capture.window_memory), said once for the summary and the report, and the rules that
judged its trace without what they read (Rule.reads)."""
from __future__ import annotations

from typing import Any, Sequence

from auditor.evidence.model import Evidence, WindowDrop
from auditor.findings import RuleResults
from auditor.rules.registry import all_rules


def judged_without(evidence: Evidence, results: RuleResults) -> list[dict[str, Any]]:
    """The rules that judged a profiler window recorded without what they read (Rule.reads):
    [{"rule", "without": [option, ...]}], skipped rules left out."""
    drop = evidence.profile.drop if evidence.profile is not None else None
    if drop is None:
        return []
    skipped = {s["rule"] for s in results.skipped}
    out: list[dict[str, Any]] = []
    for rule_id, cls in sorted(all_rules().items()):
        without = [d for d in drop.dropped if d in cls.reads]
        if without and rule_id not in skipped:
            out.append({"rule": rule_id, "without": without})
    return out


DROPPED_TEXT = {"record_shapes": "shapes (record_shapes)", "with_stack": "stacks (with_stack)"}


def window_drop_phrase(drop: WindowDrop, judged: Sequence[dict[str, Any]] = ()) -> str:
    """The profiler window recorded without shapes or stacks to fit its bounds, and the rules that
    judged its trace without what they read (`judged`: judged_without)."""
    gb = 1e9
    what = " or ".join(DROPPED_TEXT.get(d, d) for d in drop.dropped)
    bound = (f"--profile-memory (at most {drop.limit_bytes / gb:.2f} GB with its end)" if drop.reason == "memory"
             else f"--trace-size (a trace of at most {drop.trace_limit_bytes / gb:.3f} GB)")
    text = (f"profiler window recorded without {what} to keep within {bound}: a step recorded with shapes and "
            f"stacks cost {drop.step_cost_bytes / gb:.2f} GB to record and end and {drop.step_trace_bytes / gb:.3f} GB "
            f"of trace, as measured on step {drop.calibrated_on}, at which {drop.fitted} of its {drop.planned} "
            f"planned steps fitted; its reads of the process's memory decided how far it recorded")
    if judged:
        names = ", ".join(f"{j['rule']} (without {' or '.join(str(d).split('_')[-1] for d in j['without'])})"
                          for j in judged)
        text += f"; judged without them, and may find less: {names}"
    return text
