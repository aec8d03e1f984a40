"""Which steps the numerics checks run on: checked, timed and profiled steps are kept apart.

* Profiled steps (the profiler window) carry no checks: the trace is the program's, with none of
  the checks' kernels (`aminmax`) or ranges in it.
* Checked steps: every step of the first DENSE_STEPS (warm-up and the first
  learning-rate ramp, where most runs go wrong, and where the deferred checks learn the sites
  that make non-finite values by design), then every CHECK_EVERY-th step AT_EACH_RATE times, then
  at half that rate as many times, HALVINGS times: one step in 128 for good from step ~1,560 on
  (capture.cadence). Where the checks nearly double a step (the H100's host-bound encoder: ~+75%;
  a CPU step of 1,501 tiny calls: 2.4x), one step in 32 costs the steady state 2-4% and one in 128
  under 1%, in a long run whose audit may cost 5% with the probes' share. The first 536 steps are
  checked as closely as ever; a run that goes wrong later is caught by its loss (below).
  A run of SHORT_RUN steps or more reports its step time from at least TIMED_AT_LEAST timed steps:
  its dense start is cut to leave them (down to MIN_DENSE checked steps; dense_steps). A shorter
  run with SHORT_TIMED_FROM steps or more outside the profiler's window times half of them, the
  ones right after the window (timed_block: the program's steady state, past its first steps), and
  checks the others, its last steps among them, where a short run's values go wrong (a run of 10:
  steps 5-7 timed, 0, 8 and 9 checked; a run of 18: 7-13 timed). Shorter still, or without a
  profiler window (--no-profile), it is checked whole: its median comes from checked steps, and
  the reports say so.
* Timed steps: the others. Nothing of the checks runs in them; their median is the step time
  the audit reports, and comparing checked steps with them is the checks' measured cost.
* A timed step the checks did not see is still watched for its loss: the first loss each backward
  pass starts from is kept, and read once the step's time is taken (on a GPU, queued on the
  device then and read when its event has completed, never a sync). A non-finite loss, or a
  checked step whose values went wrong (Numerics._gone_wrong: not a mask's -inf by design), turns
  the checks on for every later step (but the window's), so a run that goes wrong is followed
  step by step from then on.
* The checks' cost caps their rate: each checked step past the dense start is measured by the
  program's clock (its interval, start to the next step's start, over the median of the last
  unchecked steps'), and the next check waits until the checks' share of the steps' time stays
  within CHECKS_BUDGET (Spacing). Where a checked step costs what the schedule allows (the CPU
  proxy's: +0.35 of a step, at one in 32: 1.1%) nothing changes; where one costs ~3 steps (a
  host-bound H100 step of tiny kernels, whose checks queue hundreds of launches) they run at
  most one step in ~150, down to one in MAX_SPACING, so a long run still has readings in every
  stretch.
"""
from __future__ import annotations

import statistics
from collections import deque

from auditor.capture.cadence import due

DENSE_STEPS = 24  # steps checked from the start
CHECK_EVERY = 32  # then one step in CHECK_EVERY, AT_EACH_RATE times; then half as often, HALVINGS times
AT_EACH_RATE = 16
HALVINGS = 2
SHORT_RUN = 30  # runs of at least this many steps keep TIMED_AT_LEAST of them timed
TIMED_AT_LEAST = 15
MIN_DENSE = 8  # checked steps the dense start keeps however many are to be timed
SHORT_TIMED_FROM = 6  # a short run with this many steps outside the window times half of them
CHECKS_BUDGET = 0.02  # the checks' share of a long run's step time past the dense start, at most
MAX_SPACING = 1024  # steps between two checks past the dense start, at most, whatever they cost
TIMED_KEPT = 31  # unchecked steps' intervals the checks' cost is measured against (their median)
COSTS_KEPT = 3  # checked steps' costs the spacing is set from (the least of them: see Spacing)


def dense_steps(steps: int, window: frozenset[int] | set[int]) -> int:
    """The step index the dense start ends before, for a run of `steps` (0: not known, as for a
    program audited to its end) with the profiler's `window` (see the module docstring)."""
    if steps < SHORT_RUN:
        return DENSE_STEPS
    outside = steps - len([w for w in window if w < steps])
    want = max(MIN_DENSE, outside - TIMED_AT_LEAST - 1)  # (the 1: the first of the one-in-CHECK_EVERY)
    end = n = 0
    while n < want and end < DENSE_STEPS:
        n += end not in window
        end += 1
    return end


def timed_block(steps: int, window: frozenset[int] | set[int]) -> frozenset[int]:
    """A short run's timed steps (see the module docstring): half of the steps outside the window,
    the first ones after it; none for a run of SHORT_RUN steps or more, of unknown length, or
    without a window (--no-profile: nothing marks where its first steps end, and its early steps,
    where a short run's checks matter most, would be the ones timed)."""
    if not 0 < steps < SHORT_RUN or not window:
        return frozenset()
    outside = [i for i in range(steps) if i not in window]
    if len(outside) < SHORT_TIMED_FROM:
        return frozenset()
    after = [i for i in outside if i > max(window)]
    return frozenset(after[: len(outside) // 2])


def checked(step: int, window: frozenset[int] | set[int], alarmed: bool, dense: int = DENSE_STEPS,
            not_before: int = 0, timed: frozenset[int] = frozenset()) -> bool:
    """Whether the numerics checks run on `step` (see the module docstring); `dense`: dense_steps;
    `not_before`: the first step past the dense start the checks' cost lets them run on (Spacing);
    `timed`: a short run's timed steps (timed_block), which a run gone wrong checks too."""
    if step in window:
        return False
    if alarmed:
        return True
    if step in timed:
        return False
    if step < dense:
        return True
    return step >= not_before and due(step - dense, CHECK_EVERY, AT_EACH_RATE, HALVINGS)


def spacing(cost_steps: float) -> int:
    """Steps from one check to the next that keep checks costing `cost_steps` steps each within
    CHECKS_BUDGET of the run's time (at most MAX_SPACING)."""
    return min(MAX_SPACING, max(1, int(cost_steps / CHECKS_BUDGET + 0.999)))


class Spacing:
    """The checked steps' measured cost, and the first step the next check past the dense start
    may run on (`not_before`). `began(step, checked, now)` at each step's start (`now`: the
    program's clock, perf_counter) ends the last step's interval: an unchecked step's is kept, a
    checked one's over their median is its cost, and the least of the last COSTS_KEPT costs sets the
    spacing (a genuine rise is seen once it is in all of them). Intervals that touch the profiler's window are
    not read (its start and stop are the profiler's)."""

    def __init__(self) -> None:
        self.last: tuple[int, bool, float] | None = None  # (step, checked, start) of the step begun last
        self.timed: deque[float] = deque(maxlen=TIMED_KEPT)
        self.costs: deque[float] = deque(maxlen=COSTS_KEPT)  # in steps
        self.not_before = 0
        self.cost_steps: float | None = None  # the costs' median, once measured

    def ended(self, step: int, now: float, window: frozenset[int] | set[int], dense: int) -> bool:
        """The interval of the step before `step` ends at `now`; True when a checked step's cost
        was read (and `not_before` set from it)."""
        last = self.last
        if last is None or last[0] != step - 1 or step in window or last[0] in window:
            return False
        interval = now - last[2]
        if not last[1]:
            self.timed.append(interval)
            return False
        if last[0] < dense or len(self.timed) < TIMED_KEPT // 2:
            return False
        base = statistics.median(self.timed)
        self.costs.append(max(0.0, interval - base) / base)
        if len(self.costs) < 2:  # (one interval alone may be another process's load: two must agree)
            return False
        # the least of the last two or three: another process's load only lengthens an interval, so
        # a check's own cost is in every one of them and a preemption in all of them at once spaces
        # nothing (on a loaded 2-core machine two of three checked intervals were lifted by ~1.3 steps)
        self.cost_steps = min(self.costs)
        self.not_before = last[0] + spacing(self.cost_steps)
        return True

    def began(self, step: int, checked: bool, now: float) -> None:
        self.last = (step, checked, now)
