"""manual-update: parameters updated one at a time by hand-written code instead of an optimizer."""
from __future__ import annotations

from typing import Iterable

import msgspec

from auditor.evidence import model as m
from auditor.findings import Cost, Finding, Fix
from auditor.rules._support.gpu_costs import launch_cost
from auditor.rules._support.places import by_place, locations, steps_run
from auditor.rules._support.text import line_ref, per_step
from auditor.rules.base import Option, Options, Rule
from auditor.rules.suppression import unsuppressed



class ManualUpdate(Rule):
    """
    What it detects:
        In-place updates of parameters that have a gradient, made by the program's own code in the
        step outside `Optimizer.step` -- a hand-written update loop such as
        `for p in model.parameters(): p.data.add_(p.grad, alpha=-lr)` or `p -= lr * p.grad` under
        `torch.no_grad()` -- on GPU tensors. Seen in CUDA rehearsal, at the line of the update.

    Why it costs:
        Each parameter and each arithmetic operation is its own kernel launch (a few microseconds of
        host time each, and more Python), where torch.optim's foreach implementation (the default
        on CUDA) updates all parameters in a handful of launches and `fused=True` in one. The cost
        is estimated for the device model's row (`--device`, else the default A100 SXM4 80GB): the
        updates per step less one launch per update line (what `torch._foreach_*` makes of each)
        x the row's launch latency (5 us NVIDIA, 7 us AMD); examples/gpu_manual_update.py's 6
        updates a step at one line: 5 x 5 us = 0.025 ms/step.

    Example:
        loss.backward()
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)        # one launch per parameter

    Fix:
        `opt = torch.optim.SGD(model.parameters(), lr=lr)` (or the optimizer the loop implements,
        with `foreach=True` or `fused=True`) and `opt.step()`; or `torch._foreach_add_(params, grads,
        alpha=-lr)` to keep the loop's arithmetic.

    Evidence needed:
        A CUDA rehearsal (`audit run` of CUDA code on a machine without a GPU, or `--rehearse`).
    """

    id = "manual-update"
    title = "Parameters updated one at a time outside an optimizer"
    severity = "warning"
    category = "performance"
    needs = frozenset({"run"})
    options = (
        Option("min-share-of-steps", 0.5, "Report an update site only if it runs in at least this share of steps."),
        Option("min-updates-per-step", 4,
               "... and the sites together update at least this many parameters per step (fewer is no loop)."),
    )

    @staticmethod
    def _cost(ev: m.Evidence, updates: float, lines: int) -> Cost:
        """The launches a foreach optimizer would not make, at the device model's launch latency:
        the loop's updates per step less one launch per update line (`torch._foreach_*` makes
        about one of each operation, for up to ~100s of parameters). These launches are also in
        launch-bound's count when it fires on the run: the headline's sum counts them once."""
        cost = launch_cost(ev, max(0.0, updates - lines), "per-parameter launches",
                           f"{updates:g} parameter updates/step at {lines} line(s), less the {lines} launch(es) "
                           "torch._foreach_* would make of them (about one per operation for up to ~100s of "
                           "parameters)")
        return msgspec.structs.replace(cost, within="launch-bound")

    def skip_reason(self, ev: m.Evidence) -> str | None:
        return None if ev.environment.rehearsal else "needs a CUDA rehearsal (parameter updates are counted there)"

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        if not ev.steps:
            return
        n = steps_run(ev)
        places = [p for p in by_place(ev.tallies(m.PARAM_UPDATE)) if len(p.steps) >= options.min_share_of_steps * n]
        places = unsuppressed(self.id, places, lambda p: p.where)
        count = sum(p.count for p in places)
        if not places or count / n < options.min_updates_per_step:
            return
        first = places[0].where.file if places[0].where else None
        yield self.finding(
            f"On the GPU each of these is a kernel launch per parameter: {per_step(count / n)} in-place parameter "
            "updates per step outside an optimizer, at "
            + "; ".join(f"{p.what} x{per_step(p.count / n)}/step at "
                        f"{line_ref(p.where.file if p.where else None, p.where.line if p.where else None, first)}"
                        for p in places[:5])
            + "; a foreach or fused torch.optim optimizer updates all parameters in a few launches.",
            locations=locations(places),
            evidence={"updates_per_step": round(count / n, 2), "steps": n,
                      "sites": [{"what": p.what, "file": p.where.file if p.where else None,
                                 "line": p.where.line if p.where else None, "count": p.count,
                                 "steps": len(p.steps)} for p in places]},
            cost=self._cost(ev, count / n, len(places)),
            fix=Fix(summary="Replace the loop with a torch.optim optimizer (e.g. torch.optim.SGD(model.parameters(), "
                            "lr=lr, foreach=True), or fused=True) and call opt.step(); or keep the arithmetic with "
                            "torch._foreach_add_(params, grads, alpha=-lr).",
                    config={"optimizer": {"foreach": True}}),
        )
