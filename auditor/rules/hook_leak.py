"""hook-leak: a hook registered in the step on the same tensors or modules every step piles up."""
from __future__ import annotations

from typing import Iterable

from auditor.evidence import model as m
from auditor.rules.base import Option, Options, Rule
from auditor.findings import Finding, Fix, Location
from auditor.rules._support.hooks import hook_phase, piling_hooks
from auditor.rules._support.text import file_name, per_step


class HookLeak(Rule):
    """
    What it detects:
        `Tensor.register_hook`, `register_post_accumulate_grad_hook` or an `nn.Module`
        `register_*hook` called inside the step on the same parameters or modules every step, so
        that each step adds another hook and none is removed: the line, how many tensors or modules
        it registers on, and how many hooks each holds at the first and at the last step.

    Why it costs:
        Every backward pass (every forward pass, for forward hooks) runs all the hooks a tensor
        holds: after N steps each gradient goes through N copies of the hook, and the step gets
        slower with every step (step-slowdown shows the time growing in the backward pass, not at
        the line that adds the hooks). A hook that changes the gradient (a scale) is applied N times.

    Example:
        bad:   def step(i):
                   for p in model.parameters():
                       p.register_hook(lambda g: g.clamp(-1, 1))
        good:  for p in model.parameters():          # once, at setup
                   p.register_hook(lambda g: g.clamp(-1, 1))

    Fix:
        Register the hook once, at setup, or keep the handle it returns and `handle.remove()` it
        when done. (A hook on a tensor the step makes, an activation, holds one hook and dies with
        it: that is not flagged.)

    Evidence needed:
        A run: probes on the hook registration calls count, per line and step, the registrations
        and the hooks the tensor or module holds just after.
    """

    id = "hook-leak"
    title = "Hooks registered every step pile up"
    severity = "warning"
    category = "performance"
    needs = frozenset({"run"})
    options = (
        Option("min-steps", 3, "Steps that register hooks at a line needed to judge it.", low=2),
        Option("min-growth", 0.5, "Hooks a tensor or module gains per step, on average, to flag."),
    )

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        for p in piling_hooks(ev, options.min_steps, options.min_growth):
            holders = "tensor" if p.what.startswith("Tensor.") else "module"
            at = f"{file_name(p.where.file)}:{p.where.line}" if p.where else "an unknown line"
            (s0, h0), (s1, h1) = p.first, p.last
            calls = per_step(p.per_step)
            yield self.finding(
                "Hooks pile up over the steps: register them once. "
                f"{p.what} at {at} runs in {p.steps} steps ({_n(calls, 'call')} a step, on "
                f"{_n(str(p.holders), holders)}) and the hooks pile up: a {holders} held {_n(str(h0), 'hook')} "
                f"after step {s0} and {h1} after step {s1} (+{per_step(p.growth)} a step), and every "
                f"{hook_phase(p.what)} pass runs all of them.",
                locations=[Location.of(p.where)] if p.where else [],
                evidence={"what": p.what, "steps": p.steps, "calls_per_step": p.per_step, "holders": p.holders,
                          "held_first": {"step": s0, "hooks": h0}, "held_last": {"step": s1, "hooks": h1},
                          "growth_per_step": round(p.growth, 3)},
                cost=None,
                fix=Fix(summary="Register the hook once, at setup (outside the step), or keep the handle it returns "
                                "and call handle.remove() when it is no longer needed."),
            )


def _n(count: str, word: str) -> str:
    """`1 call`, `52 calls`."""
    return f"{count} {word}{'' if count == '1' else 's'}"
