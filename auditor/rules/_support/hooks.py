"""Hook registrations that pile up on the same tensors or modules, step after step."""
from __future__ import annotations

from dataclasses import dataclass
from statistics import median

from auditor.evidence.model import HOOK, Evidence, Tally
from auditor.evidence.frame import Frame
from auditor.rules._support.places import place_key


@dataclass
class PilingHooks:
    """Hooks registered at one line that pile up on the same tensors or modules step after step."""

    what: str  # Tensor.register_hook, Module.register_forward_hook ...
    where: Frame | None
    steps: int  # steps that registered hooks there
    per_step: float  # registrations per step there (median)
    holders: int  # tensors or modules registered on, in the last such step
    first: tuple[int, int]  # (step, hooks held) of the first step that registered there
    last: tuple[int, int]  # ... and of the last

    @property
    def growth(self) -> float:
        """Hooks each holder gained per step, on average."""
        return (self.last[1] - self.first[1]) / max(1, self.last[0] - self.first[0])


def piling_hooks(ev: Evidence, min_steps: int = 3, min_growth: float = 0.5) -> list[PilingHooks]:
    """The lines whose hook registrations pile up: in at least `min_steps` steps, with the most
    hooks one holder has after them growing by `min_growth` a step or more. A hook registered
    every step on a new tensor (an activation of that step) holds one hook each time: not piling."""
    series: dict[tuple, list[tuple[int, Tally]]] = {}
    for step, t in ev.tallies(HOOK):
        series.setdefault(place_key(t), []).append((step, t))
    out = []
    for pairs in series.values():
        pairs.sort(key=lambda p: p[0])
        (s0, t0), (s1, t1) = pairs[0], pairs[-1]
        h0, h1 = int(t0.data.get("held", 0)), int(t1.data.get("held", 0))
        if len(pairs) < min_steps or h1 - h0 < 2 or (h1 - h0) / max(1, s1 - s0) < min_growth:
            continue
        out.append(PilingHooks(what=t1.what, where=t1.where, steps=len(pairs),
                               per_step=median([t.count for _, t in pairs]),
                               holders=int(t1.data.get("holders", 0)), first=(s0, h0), last=(s1, h1)))
    return sorted(out, key=lambda p: -p.last[1])


def hook_phase(what: str) -> str:
    """The pass that runs the hooks a registration adds."""
    return "forward" if "forward" in what else "backward"
