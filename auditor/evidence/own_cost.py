"""The audit's own cost, measured between the run's steps (auditor.capture.numerics.schedule):
timed steps (nothing of the audit's in them) against the steps that carried the numerics checks,
and unprofiled steps against the profiled ones. Medians of each step's time on its bound's clock
(StepRecord.time_ms: host work the device waits behind costs a device-bound step nothing);
failed steps left out."""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from auditor.evidence.model import Evidence


class OwnCost(msgspec.Struct):
    timed_steps: list[int]  # not profiled, not checked: the steps whose median the reports state
    checked_steps: list[int]  # not profiled, numerics-checked
    profiled_steps: list[int]
    timed_ms: float | None = None  # medians of each kind
    checked_ms: float | None = None
    profiled_ms: float | None = None
    unprofiled_ms: float | None = None  # checked and timed steps together
    # the checks' cost, where it spaced them further apart than the schedule (numerics.schedule
    # Spacing): a checked step's time over the unchecked steps', in steps (the last measured), the
    # steps its check kept the next one from, and the budget the spacing keeps them within
    check_cost_steps: float | None = None
    check_spacing: int | None = None
    check_budget: float | None = None


def own_cost(evidence: Evidence) -> OwnCost:
    ok = [s for s in evidence.steps if not s.failed]
    t = evidence.timed_steps()
    timed_ids = {s.index for s in t}
    checked = [s for s in ok if not s.profiled and s.numerics is not None]
    profiled = [s for s in ok if s.profiled]
    unprofiled = [s for s in ok if not s.profiled]

    def med(steps: list) -> float | None:
        return round(statistics.median(s.time_ms for s in steps), 3) if steps else None

    from auditor.evidence.numerics_view import NumericsView

    spaced = NumericsView.of(evidence).events_of("checks-spaced") if evidence.steps else []
    last = spaced[-1] if spaced else {}
    return OwnCost(timed_steps=sorted(timed_ids), checked_steps=[s.index for s in checked],
                   profiled_steps=[s.index for s in profiled], timed_ms=med(t), checked_ms=med(checked),
                   profiled_ms=med(profiled), unprofiled_ms=med(unprofiled),
                   check_cost_steps=last.get("cost_steps"),
                   check_spacing=last["not_before"] - last["step"] if last else None,
                   check_budget=last.get("budget"))
