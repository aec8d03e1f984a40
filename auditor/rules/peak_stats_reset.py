"""peak-stats-reset: the CUDA memory statistics reset every step."""
from __future__ import annotations

from typing import Iterable

from auditor.evidence import model as m
from auditor.rules.base import Option, Options, Rule
from auditor.findings import Cost, Finding, Fix
from auditor.rules._support.gpu_costs import sync_cost
from auditor.rules._support.places import (by_place, locations, median_cost_of, on_accelerator, place_key,
                                           step_ms_of, steps_run)
from auditor.fixes import remove_statement
from auditor.rules.suppression import unsuppressed


class PeakStatsReset(Rule):
    """
    What it detects:
        `torch.cuda.reset_peak_memory_stats()` (or `reset_max_memory_allocated`,
        `reset_max_memory_cached`, `reset_accumulated_memory_stats`) called in most steps.

    Why it costs:
        Resetting the allocator's statistics synchronises the device each time, so a debugging
        aid left in the loop turns into a per-step stall ("training slows down after the first batch").

    Example:
        bad:   torch.cuda.reset_peak_memory_stats()            # every step
        good:  if step % 500 == 0: log(torch.cuda.max_memory_allocated()); reset once

    Fix:
        Remove it from the step, or measure peaks every few hundred steps. The patch replaces the
        call with `pass`.

    Evidence needed:
        A run: probes on the reset functions (recorded on CPU-only machines too, where the auditor
        answers them as an idle device would).
    """

    id = "peak-stats-reset"
    title = "CUDA memory statistics are reset every step"
    severity = "warning"
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
        real = on_accelerator(ev)
        # measured on the device: the median time of the steps that reset, against the median step
        cost = median_cost_of(ev, step_ms_of(ev, (m.STAT_RESET,), {place_key(p) for p in places})) if real \
            else sync_cost(ev, count / n, "synchronising call") if ev.environment.rehearsal else Cost(
            ms_per_step=None, share_of_step=None, measured=False,
            note="not measured: no CUDA device here (each call syncs the device on a GPU)")
        locs = locations(places)
        edits = [e for loc in locs if (e := remove_statement(loc.file, loc.line, "audit: per-step stat reset removed"))]
        yield self.finding(
            f"{places[0].what}() ran {count} times in {len(steps_with)} of {n} steps; each call synchronises "
            "the device.",
            locations=locs,
            evidence={"calls": count, "steps_with_reset": len(steps_with), "steps": n,
                      "functions": sorted({p.what for p in places})},
            cost=cost,
            fix=Fix(summary="Reset and read peak memory every few hundred steps, not every step.",
                    config={"reset_peak_memory_stats": "every 500 steps or never"}, edits=edits),
        )
