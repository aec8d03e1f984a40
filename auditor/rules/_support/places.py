"""Tallies grouped by the source line they were counted at, and what they cost per step of a run."""
from __future__ import annotations

from dataclasses import dataclass, field

from auditor.evidence.model import Evidence, Tally
from auditor.evidence.frame import Frame
from auditor.findings import Cost, Location, share_of_step, step_basis_ms


@dataclass
class Place:
    """All tallies of one kind at one source location, across steps."""

    where: Frame | None
    what: str
    steps: set[int] = field(default_factory=set)
    count: int = 0
    ms: float = 0.0
    data: dict = field(default_factory=dict)
    # what made the calls at a user's line that only called into a library (the tallies' "via",
    # capture.frames.library_via): every one seen, as one line may call a framework doing several
    vias: set[str] = field(default_factory=set)


def place_key(t: Tally | Place) -> tuple:
    """(what, file, line): the place a tally (or a Place of them) is counted at."""
    return t.what, t.where.file if t.where else None, t.where.line if t.where else None


def by_place(pairs: list[tuple[int, Tally]]) -> list[Place]:
    """Group (step, tally) pairs by (what, file, line); most frequent first."""
    places: dict[tuple, Place] = {}
    for step, t in pairs:
        key = place_key(t)
        p = places.setdefault(key, Place(where=t.where, what=t.what))
        p.steps.add(step)
        p.count += t.count
        p.ms += t.ms
        for k, v in t.data.items():
            p.data.setdefault(k, v)
        if t.data.get("via"):
            p.vias.add(t.data["via"])
    return sorted(places.values(), key=lambda p: (-p.count, p.what))


def locations(places: list[Place]) -> list[Location]:
    seen, out = set(), []
    for p in places:
        if p.where and (p.where.file, p.where.line) not in seen:
            seen.add((p.where.file, p.where.line))
            out.append(Location.of(p.where))
    return out


def steps_run(ev: Evidence) -> int:
    return max(1, len(ev.steps))


def cost_of(ev: Evidence, total_ms: float, measured: bool = True, note: str | None = None) -> Cost:
    """Cost per step of `total_ms` spread over the run, and its share of the median step."""
    per_step = round(total_ms / steps_run(ev), 3)
    return Cost(ms_per_step=per_step, share_of_step=share_of_step(per_step, step_basis_ms(ev)),
                measured=measured, note=note)


def on_accelerator(ev: Evidence) -> bool:
    """Whether the audited program really computed on a CUDA device."""
    return ev.environment.cuda_available and ev.environment.device == "cuda"
