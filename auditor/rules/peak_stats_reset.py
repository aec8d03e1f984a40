"""peak-stats-reset: the CUDA memory statistics reset every step."""
from __future__ import annotations

from typing import Iterable

from auditor.evidence import model as m
from auditor.rules.base import Option, Options, Rule
from auditor.findings import Cost, Finding, Fix
from auditor.rules._support.places import (by_place, locations, median_cost_of, on_accelerator, place_key,
                                           step_ms_of, steps_run)
from auditor.fixes import remove_statement
from auditor.rules.suppression import unsuppressed


HOST_TIME = "the calls' own host time, with no device sync"


class PeakStatsReset(Rule):
    """
    What it detects:
        `torch.cuda.reset_peak_memory_stats()` (or `reset_max_memory_allocated`,
        `reset_max_memory_cached`, `reset_accumulated_memory_stats`) called in most steps.

    Why it costs:
        A debugging aid left in the loop: each call takes the host a Python call and the
        allocator's lock, and leaves the peaks the program reads covering one step. It does not
        synchronise the device (an H100 recording of examples/demo.py: 1.4-1.6 us of C++ a call,
        no CUDA call under it), so its cost is the calls' own host time, which a host-bound step
        pays in full and a device-bound one not at all; the GPU's idle behind the step's syncs is
        host-sync's.

    Example:
        bad:   torch.cuda.reset_peak_memory_stats()            # every step
        good:  if step % 500 == 0: log(torch.cuda.max_memory_allocated()); reset once

    Fix:
        Remove it from the step, or measure peaks every few hundred steps. The patch replaces the
        call with `pass`.

    Evidence needed:
        A run: probes on the reset functions, timed (recorded on CPU-only machines too, where the
        auditor answers them as an idle device would; a CUDA rehearsal times its stand-in's call).
    """

    id = "peak-stats-reset"
    title = "CUDA memory statistics are reset every step"
    severity = "warning"
    warns_uncounted = "on a GPU each reset is host time in every step: one line takes it out"
    category = "performance"
    needs = frozenset({"run"})
    options = (Option("min-share-of-steps", 0.5, "Flag when resets happen in at least this share of steps."),)

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        n = steps_run(ev)
        # a suppressed call neither counts nor helps reach the threshold
        places = unsuppressed(self.id, by_place(ev.tallies(m.STAT_RESET)), lambda p: p.where)
        steps_with = set().union(*(p.steps for p in places)) if places else set()
        if not places or len(steps_with) < options.min_share_of_steps * n:
            return
        count = sum(p.count for p in places)
        # the calls' own host time (no device sync: see Why it costs), the median of the steps that
        # reset against the median step; a rehearsal's is its stand-in's call, the Python part of it
        timed = step_ms_of(ev, (m.STAT_RESET,), {place_key(p) for p in places})
        if on_accelerator(ev):
            cost = median_cost_of(ev, timed, HOST_TIME)
        elif ev.environment.rehearsal:
            cost = median_cost_of(ev, timed, HOST_TIME + ", as rehearsed (the CPU stand-in's Python call)")
        else:
            cost = Cost(ms_per_step=None, share_of_step=None, measured=False,
                        note="not measured: no CUDA device here (on a GPU each call is host time, no device sync)")
        locs = locations(places)
        edits = [e for loc in locs if (e := remove_statement(loc.file, loc.line, "audit: per-step stat reset removed"))]
        yield self.finding(
            "Peak memory stats are reset in the loop: do it rarely. "
            f"The call {places[0].what}() ran {count} times in {len(steps_with)} of {n} steps: a debugging aid left in the "
            "loop, which leaves the peaks the program reads covering one step. Each call resets the allocator's "
            "counters on the host and does not synchronise the device; its cost is the calls' host time.",
            locations=locs,
            evidence={"calls": count, "steps_with_reset": len(steps_with), "steps": n,
                      "functions": sorted({p.what for p in places})},
            cost=cost,
            fix=Fix(summary="Reset and read peak memory every few hundred steps, not every step.",
                    config={"reset_peak_memory_stats": "every 500 steps or never"}, edits=edits),
        )
