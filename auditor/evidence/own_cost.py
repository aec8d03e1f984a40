"""The audit's own cost, measured between the run's steps (auditor.capture.numerics.schedule):
timed steps (nothing of the audit's in them) against the steps that carried the numerics checks,
and unprofiled steps against the profiled ones. Medians of each step's time on its bound's clock
(StepRecord.time_ms: host work the device waits behind costs a device-bound step nothing);
failed steps left out. Where the program ran several training loops (auditor.evidence.loops),
each pair is compared within one loop, the one with the most steps of both kinds: a checked step of
one model's loop against a timed step of another's would measure the models."""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

import msgspec

from auditor.evidence.loops import loops

if TYPE_CHECKING:
    from auditor.evidence.model import Evidence


class OwnCost(msgspec.Struct):
    timed_steps: list[int]  # not profiled, not checked: the steps whose median the reports state
    checked_steps: list[int]  # not profiled, numerics-checked
    profiled_steps: list[int]
    timed_ms: float | None = None  # medians of each kind
    checked_ms: float | None = None
    profiled_ms: float | None = None
    # the median of the steps the profiled ones are set against (profile_base): the timed ones,
    # which carry no checks either (a checked step can cost many times a step: minGPT's adder's
    # 17.6x read as its profiled steps "72% faster" than the checked and timed together); every
    # unprofiled step where no loop has timed and profiled steps both
    unprofiled_ms: float | None = None
    profile_base: str = "timed"  # "timed" | "unprofiled"
    # the checks' cost, where it spaced them further apart than the schedule (numerics.schedule
    # Spacing): a checked step's time over the unchecked steps', in steps (the last measured), the
    # steps its check kept the next one from, and the budget the spacing keeps them within
    check_cost_steps: float | None = None
    check_spacing: int | None = None
    check_budget: float | None = None
    # where the run had several loops: the first and last step of the loop each comparison was made
    # in (checked_ms against timed_ms; profiled_ms against unprofiled_ms), [] where no loop had
    # steps of both kinds (the medians are then the whole run's), and how many loops ran
    checks_compared_in: list[int] | None = None
    profile_compared_in: list[int] | None = None
    loops: int = 1


def _within(parts: list[list], one: set[int], other: set[int]) -> tuple[set[int], set[int], list[int] | None]:
    """`one` and `other` (step indices) narrowed to the loop of `parts` holding the most of both
    (the most of the fewer kind), and that loop's first and last step; as they are with one loop."""
    if len(parts) < 2 or not one or not other:
        return one, other, None
    best = max(parts, key=lambda p: min(sum(s.index in one for s in p), sum(s.index in other for s in p)))
    ids = {s.index for s in best}
    if not (one & ids and other & ids):  # no loop has both: nothing like with like ([]: said so)
        return one, other, []
    return one & ids, other & ids, [best[0].index, best[-1].index]


def own_cost(evidence: Evidence) -> OwnCost:
    ok = [s for s in evidence.steps if not s.failed]
    t = evidence.timed_steps()
    timed_ids = {s.index for s in t}
    checked = [s for s in ok if not s.profiled and s.numerics is not None]
    profiled = [s for s in ok if s.profiled]
    unprofiled = [s for s in ok if not s.profiled]
    parts = loops(ok)
    timed_in, checked_in, checks_loop = _within(parts, timed_ids, {s.index for s in checked})
    profiled_ids, profile_base = {s.index for s in profiled}, "timed"
    profiled_in, unprofiled_in, profile_loop = _within(parts, profiled_ids, timed_ids)
    if not timed_ids or profile_loop == []:
        profile_base = "unprofiled"
        profiled_in, unprofiled_in, profile_loop = _within(parts, profiled_ids, {s.index for s in unprofiled})

    def med(ids: set[int]) -> float | None:
        times = [s.time_ms for s in ok if s.index in ids]
        return round(statistics.median(times), 3) if times else None

    from auditor.evidence.numerics_view import NumericsView

    spaced = NumericsView.of(evidence).events_of("checks-spaced") if evidence.steps else []
    last = spaced[-1] if spaced else {}
    return OwnCost(timed_steps=sorted(timed_ids), checked_steps=[s.index for s in checked],
                   profiled_steps=[s.index for s in profiled], timed_ms=med(timed_in), checked_ms=med(checked_in),
                   profiled_ms=med(profiled_in), unprofiled_ms=med(unprofiled_in), profile_base=profile_base,
                   check_cost_steps=last.get("cost_steps"),
                   check_spacing=last["not_before"] - last["step"] if last else None,
                   check_budget=last.get("budget"), checks_compared_in=checks_loop,
                   profile_compared_in=profile_loop, loops=len(parts))
