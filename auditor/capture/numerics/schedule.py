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
  run is checked first: its median comes from the few steps left.
* Timed steps: the others. Nothing of the checks runs in them; their median is the step time
  the audit reports, and comparing checked steps with them is the checks' measured cost.
* A timed step the checks did not see is still watched for its loss: the first loss each backward
  pass starts from is kept, and read once the step's time is taken (on a GPU, queued on the
  device then and read when its event has completed, never a sync). A non-finite loss, or a
  checked step whose values went wrong (Numerics._gone_wrong: not a mask's -inf by design), turns
  the checks on for every later step (but the window's), so a run that goes wrong is followed
  step by step from then on.
"""
from __future__ import annotations

from auditor.capture.cadence import due

DENSE_STEPS = 24  # steps checked from the start
CHECK_EVERY = 32  # then one step in CHECK_EVERY, AT_EACH_RATE times; then half as often, HALVINGS times
AT_EACH_RATE = 16
HALVINGS = 2
SHORT_RUN = 30  # runs of at least this many steps keep TIMED_AT_LEAST of them timed
TIMED_AT_LEAST = 15
MIN_DENSE = 8  # checked steps the dense start keeps however many are to be timed


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


def checked(step: int, window: frozenset[int] | set[int], alarmed: bool, dense: int = DENSE_STEPS) -> bool:
    """Whether the numerics checks run on `step` (see the module docstring); `dense`: dense_steps."""
    if step in window:
        return False
    if alarmed or step < dense:
        return True
    return due(step - dense, CHECK_EVERY, AT_EACH_RATE, HALVINGS)
