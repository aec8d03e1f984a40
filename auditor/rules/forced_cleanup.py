"""forced-cleanup: torch.cuda.empty_cache() / gc.collect() every step or every few steps."""
from __future__ import annotations

from typing import Iterable

from auditor.evidence import model as m
from auditor.rules.base import Option, Options, Rule
from auditor.findings import Cost, Finding, Fix
from auditor.rules._support.frameworks import framework_fix
from auditor.rules._support.gpu_costs import sync_cost
from auditor.rules._support.confidence import cost_confidence, cpu_over_wall
from auditor.rules._support.places import (by_place, locations, median_cost_of, on_accelerator, place_key,
                                           step_ms_of, steps_over, steps_run)
from auditor.fixes import remove_statement
from auditor.rules.suppression import unsuppressed


EMPTY_CACHE = "torch.cuda.empty_cache"
EMPTY_CACHES = (EMPTY_CACHE, "torch.accelerator.empty_cache")
COUNTED = "counted, not timed: no CUDA device here, where empty_cache() frees nothing"


def _what(places: list) -> str:
    return " and ".join(sorted({f"{p.what}()" for p in places}))


class ForcedCleanup(Rule):
    """
    What it detects:
        `torch.cuda.empty_cache()` and/or `gc.collect()` called every step or every few steps,
        with the share of step time they take: the median time of the steps that make them, times
        the share of steps that do, against the median step (a few slow collections do not lift
        it), and how firm that number is (the spread of those steps' times).

    Why it costs:
        gc.collect() walks every Python object (tens of milliseconds in a process with torch
        loaded); empty_cache() returns cached blocks to the driver, so the next step must
        cudaMalloc them again (slow, and synchronising). Neither fixes a real leak.

    Example:
        bad:   loss.backward(); opt.step(); gc.collect(); torch.cuda.empty_cache()
        good:  drop the calls; fix what holds memory (see graph-leak, memory-growth)

    Fix:
        Remove the calls from the step. The patch replaces each with `pass`.

    Evidence needed:
        A run: timed probes on gc.collect and torch.cuda.empty_cache. Without a CUDA device (a
        CPU run, or CUDA rehearsal) empty_cache() frees nothing and its cost is counted, not timed.
    """

    id = "forced-cleanup"
    title = "Memory cleanup forced every few steps"
    severity = "warning"
    warns_uncounted = "on a GPU each forced cleanup makes the next steps allocate their memory again"
    category = "performance"
    needs = frozenset({"run"})
    options = (Option("max-interval", 5, "Flag calls made at least once every this many steps.", low=1),)

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        n = steps_run(ev)
        places = [p for p in by_place(ev.tallies(m.EMPTY_CACHE) + ev.tallies(m.GC_COLLECT))
                  if len(p.steps) >= n / options.max_interval]
        places = unsuppressed(self.id, places, lambda p: p.where)  # out of the count, message and evidence
        if not places:
            return
        # without a device, empty_cache() is answered by a stand-in that frees nothing: its time is no cost
        device = on_accelerator(ev)
        timed = [p for p in places if device or p.what not in EMPTY_CACHES]
        counted = [p for p in places if p not in timed]
        parts = []
        confidence, confidence_text = {}, ""
        if timed:
            # like with like: the median step's share is of the median cleanup time (a mean that
            # a few slow collections lift can read more than the whole step)
            per_step = step_ms_of(ev, (m.EMPTY_CACHE, m.GC_COLLECT), {place_key(p) for p in timed})
            cost = median_cost_of(ev, per_step)
            total = sum(per_step.values())
            mean = total / steps_over(ev, per_step)
            parts.append(f"{_what(timed)} ran {sum(p.count for p in timed)} times in {n} steps, costing "
                         f"{cost.ms_per_step:.2f} ms per step ({(cost.share_of_step or 0) * 100:.1f}% of the "
                         "run's time)"
                         + (f"; mean {mean:.2f} ms, raised by steps where it took up to {max(per_step.values()):.2f} ms"
                            if abs(mean - (cost.ms_per_step or 0.0)) > 0.1 * max(cost.ms_per_step or 0.0, 1e-9) else ""))
            # the verdict is a count (calls every few steps): only the cost is timed, and its
            # confidence is how firm that number is under the run's load
            confidence, confidence_text = cost_confidence(list(per_step.values()), cpu_over_wall(ev.steps),
                                                          _what(timed))
        elif ev.environment.rehearsal:  # rehearsed: each empty_cache() synchronises the device (cudaFree)
            cost = sync_cost(ev, sum(p.count for p in counted) / n, "empty_cache() call")
        else:
            cost = Cost(ms_per_step=None, share_of_step=None, measured=False, note=COUNTED)
        if counted:
            parts.append(f"{_what(counted)} ran {sum(p.count for p in counted)} times in {n} steps: on a GPU "
                         "each call waits for the device and hands its cached blocks back to the driver, which the "
                         "next steps must cudaMalloc again (not timed: no CUDA device here)")
        locs = locations(places)
        # (an edit removing a line that only called into a library is dropped by the engine:
        # fixes.refused_edit; the framework's setting is the fix there)
        edits = [e for loc in locs if (e := remove_statement(loc.file, loc.line, "audit: forced cleanup removed"))]
        fw_config, fw_advice = framework_fix(places)
        yield self.finding(
            "Forced cleanup runs in the step: remove it or run it rarely. In this run "
            + "; ".join(parts) + "." + (f" {confidence_text}" if confidence_text else ""),
            locations=locs,
            evidence={"calls": [{"what": p.what, "count": p.count, "steps": len(p.steps), "ms": round(p.ms, 3),
                                 "line": p.where.line if p.where else None, "timed": p in timed} for p in places],
                      **confidence},
            cost=cost,
            fix=Fix(summary="".join(a + ". " for a in fw_advice)
                    + "Remove per-step gc.collect()/empty_cache(); fix what holds the memory instead.",
                    config={**fw_config, "gc.collect": "off", "torch.cuda.empty_cache": "off"}, edits=edits),
        )
