"""Tallies grouped by the source line they were counted at, and what they cost per step of a run."""
from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median
from typing import Callable

from auditor.evidence.model import Evidence, Tally
from auditor.evidence.frame import Frame
from auditor.findings import Cost, Location, share_of_step, step_basis_ms
from auditor.rules._support.text import line_ref


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
    direct: int = 0  # the calls the user's code made itself (no via)


# A step that made more than this many times the median step's calls of a kind is a one-off burst
# (see typical_pairs)
BURST_FACTOR = 10


@dataclass
class Typical:
    """A kind's (step, tally) pairs over the steps a per-step rate counts, `n` of them, and the
    bursts left out: {step: its calls} (typical_pairs)."""

    pairs: list[tuple[int, Tally]]
    n: int
    left_out: dict[int, int]
    median_calls: float
    burst: list[tuple[int, Tally]] = field(default_factory=list)  # the pairs left out

    def note(self, headline_file: str | None = None) -> str:
        """The message's words for what was left out ("" when nothing was): each burst's calls, and
        the places that made most of them (the burst's calls may come from lines the per-step
        counts never see, as a learner's first step holds the actions of its first rollout)."""
        if not self.left_out:
            return ""
        steps = []
        for s, k in sorted(self.left_out.items()):
            places = by_place([(i, t) for i, t in self.burst if i == s])
            made = ", ".join(f"{p.what} x{p.count:,} at "
                             + line_ref(p.where.file if p.where else None, p.where.line if p.where else None, headline_file)
                             for p in places[:2]) + (", ..." if len(places) > 2 else "")
            steps.append(f"step {s} ({k:,}: {made})" if made else f"step {s} ({k:,})")
        return (f" (left out of the per-step counts, as a one-off burst of calls: {', '.join(steps)}, against "
                f"{self.median_calls:g} in the median step)")

    def left_out_steps(self) -> dict[str, int]:
        """The finding's evidence of what was left out: {step (as a JSON key): its calls}."""
        return {str(k): v for k, v in self.left_out.items()}


def typical_pairs(ev: Evidence, kind: str, counted: Callable[[list], list] | None = None) -> Typical:
    """The tallies of `kind` over the steps a per-step rate is read from: every step but a one-off
    burst, where a step made more than BURST_FACTOR times the median step's calls of the kind
    (minGPT's chargpt samples 500 tokens in its first step's callback: 46,593 rehearsed kernel
    launches there against 93 in each of the other 29 steps, which read as 1,643 a step), in a
    run of at least 3 steps where the bursts are under a quarter of the steps. The summary names
    such a step apart where it took most of the run's time; a rate over it describes no step.
    `counted`: the pairs that count, of all the kind's (host-sync's one fetch of `.cpu().numpy()`)."""
    pairs = ev.tallies(kind) if counted is None else counted(ev.tallies(kind))
    n = steps_run(ev)
    calls: dict[int, int] = {s.index: 0 for s in ev.steps}
    for step, t in pairs:
        calls[step] = calls.get(step, 0) + t.count
    mid = median(calls.values()) if calls else 0
    bursts = {s: k for s, k in calls.items() if mid > 0 and k > BURST_FACTOR * mid}
    if len(calls) < 3 or not bursts or len(bursts) * 4 >= len(calls):
        return Typical(pairs, n, {}, mid)
    return Typical([(s, t) for s, t in pairs if s not in bursts], max(1, n - len(bursts)), bursts, mid,
                   [(s, t) for s, t in pairs if s in bursts])


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
        else:
            p.direct += t.count
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


def step_ms_of(ev: Evidence, kinds: tuple[str, ...], keys: set[tuple]) -> dict[int, float]:
    """Per step that made them: the ms of the tallies of `kinds` counted at the places `keys`
    (place_key), read over the steps the median step is of (Evidence.median_basis: the timed ones)
    where any of those made them: the profiled and checked steps' calls run under the audit's own
    work, and a median read over them can exceed the median step. Else over every step."""
    out: dict[int, float] = {}
    for kind in kinds:
        for step, t in ev.tallies(kind):
            if place_key(t) in keys:
                out[step] = out.get(step, 0.0) + t.ms
    basis = {s.index for s in ev.median_basis()}
    return {k: v for k, v in out.items() if k in basis} or out


def steps_over(ev: Evidence, per_step: dict[int, float]) -> int:
    """How many steps `per_step` (step_ms_of) was read over: the median step's when it holds only
    those, else the run's."""
    basis = {s.index for s in ev.median_basis()}
    return max(1, len(basis)) if per_step and set(per_step) <= basis else steps_run(ev)


MEDIAN_COST = "the median of the steps that made the calls, times the share of steps that made them"


def median_cost_of(ev: Evidence, per_step: dict[int, float], note: str | None = None) -> Cost:
    """Cost per step of calls timed in some or all steps (`per_step`: ms in each step that made
    them), set against the median step with the same statistic: the median of the steps that made
    them, times the share of the run's steps that did (a call every third step costs a third of
    its median). A mean over the steps would let a few slow calls lift the cost above every step's
    but theirs. The note says so (MEDIAN_COST) after `note`."""
    if not per_step:
        return Cost(ms_per_step=None, share_of_step=None, measured=True, note=note)
    ms = round(median(per_step.values()) * min(1.0, len(per_step) / steps_over(ev, per_step)), 3)
    return Cost(ms_per_step=ms, share_of_step=share_of_step(ms, step_basis_ms(ev)), measured=True,
                note=(f"{note}; " if note else "") + MEDIAN_COST + ", against the median step")


def on_accelerator(ev: Evidence) -> bool:
    """Whether the audited program really computed on a CUDA device."""
    return ev.environment.cuda_available and ev.environment.device == "cuda"
