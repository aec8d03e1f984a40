"""What the profiler trace was recorded without (shapes, stacks), said once for the summary and the
report, and the rules that judged it without what they read (Rule.reads).

A run's window says what it dropped to fit its bounds (evidence.profile.drop: see
auditor.capture.window_memory); recordings analysed on their own (`audit analyze TRACE`) say it in
themselves (auditor.evidence.trace.recorded: a user's torch.profiler run with record_shapes=False or
with_stack=False, or the auditor's dropped window's trace given alone)."""
from __future__ import annotations

from typing import Any, Sequence

from auditor.evidence.model import Evidence, WindowDrop
from auditor.evidence.trace.recorded import OPTIONS, recorded_without
from auditor.findings import RuleResults
from auditor.rules.registry import all_rules


def traces_without(evidence: Evidence) -> list[tuple[str, tuple[str, ...]]]:
    """(label, options it lacks) of each parsed trace recorded without an option a rule reads, for
    recordings analysed on their own; empty for a run, whose window says what it dropped."""
    if evidence.profile is not None:
        return []
    return [(t.label, w) for t in evidence.trace_data if (w := recorded_without(t))]


def recorded_without_any(evidence: Evidence) -> list[str]:
    """The options (OPTIONS) the evidence's traces were recorded without: a run's, what its window
    dropped; recordings', what any of them lacks."""
    if evidence.profile is not None:
        return list(evidence.profile.drop.dropped) if evidence.profile.drop is not None else []
    lacking = {o for _, w in traces_without(evidence) for o in w}
    return [o for o in OPTIONS if o in lacking]


def judged_without(evidence: Evidence, results: RuleResults) -> list[dict[str, Any]]:
    """The rules that judged a trace recorded without what they read (Rule.reads):
    [{"rule", "without": [option, ...]}], skipped rules left out."""
    dropped = recorded_without_any(evidence)
    if not dropped:
        return []
    skipped = {s["rule"] for s in results.skipped}
    out: list[dict[str, Any]] = []
    for rule_id, cls in sorted(all_rules().items()):
        without = [d for d in dropped if d in cls.reads]
        if without and rule_id not in skipped:
            out.append({"rule": rule_id, "without": without})
    return out


DROPPED_TEXT = {"record_shapes": "shapes (record_shapes)", "with_stack": "stacks (with_stack)"}


def _what(options: Sequence[str]) -> str:
    return " or ".join(DROPPED_TEXT.get(o, o) for o in options)


def _judged_text(judged: Sequence[dict[str, Any]]) -> str:
    names = ", ".join(f"{j['rule']} (without {' or '.join(str(d).split('_')[-1] for d in j['without'])})"
                      for j in judged)
    return f"; judged without them, and may find less: {names}"


def window_drop_phrase(drop: WindowDrop, judged: Sequence[dict[str, Any]] = ()) -> str:
    """The profiler window recorded without shapes or stacks to fit its bounds, and the rules that
    judged its trace without what they read (`judged`: judged_without)."""
    gb = 1e9
    what = _what(drop.dropped)
    bound = (f"--profile-memory (at most {drop.limit_bytes / gb:.2f} GB with its end)" if drop.reason == "memory"
             else f"--trace-size (a trace of at most {drop.trace_limit_bytes / gb:.3f} GB)")
    text = (f"profiler window recorded without {what} to keep within {bound}: a step recorded with shapes and "
            f"stacks cost {drop.step_cost_bytes / gb:.2f} GB to record and end and {drop.step_trace_bytes / gb:.3f} GB "
            f"of trace, as measured on step {drop.calibrated_on}, at which {drop.fitted} of its {drop.planned} "
            f"planned steps fitted; its reads of the process's memory decided how far it recorded")
    return text + _judged_text(judged) if judged else text


def traces_without_phrase(without: Sequence[tuple[str, Sequence[str]]],
                          judged: Sequence[dict[str, Any]] = ()) -> str:
    """The traces analysed on their own that were recorded without shapes or stacks (`without`:
    traces_without), and the rules that judged them without what they read (`judged`). Traces that
    lack the same are named together, the first NAMED_TRACES of them: one line however many."""
    if len(without) == 1:
        label, options = without[0]
        text = f"profiler trace {label} was recorded without {_what(options)}"
    else:
        groups: dict[tuple[str, ...], list[str]] = {}
        for label, options in without:
            groups.setdefault(tuple(options), []).append(label)
        text = "profiler traces were recorded without what some rules read: " + "; ".join(
            f"{_named(labels)} without {_what(options)}" for options, labels in groups.items())
    lacking = [o for o in OPTIONS if any(o in w for _, w in without)]
    text += (f" (torch.profiler.profile({', '.join(f'{o}=True' for o in lacking)}) records "
             f"{'them' if len(lacking) > 1 else 'it'})")
    return text + _judged_text(judged) if judged else text


NAMED_TRACES = 3  # traces named in the note; the others counted


def _named(labels: Sequence[str]) -> str:
    shown = ", ".join(labels[:NAMED_TRACES])
    return shown if len(labels) <= NAMED_TRACES else f"{shown} and {len(labels) - NAMED_TRACES:,} more"
