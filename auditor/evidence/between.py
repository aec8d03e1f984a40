"""The time a whole program spent between its audited steps, and what its probes saw there.

The median step leaves out what runs outside the steps: an evaluation loop, a checkpoint save, a
reinforcement learner's rollout between its updates (128 actions under no_grad, each fetched to the
host for the environment). The run's time counts it (auditor.evidence.run_time), and where it is a
large part of it, work-between-steps says so, with the work the probes timed there.
"""
from __future__ import annotations

from statistics import median

import msgspec

from auditor.evidence import model as m
from auditor.evidence.frame import Frame

# The kinds of the probes' timed tallies named in a stretch's work, each at its outermost level
# (a `.item()` inside a forward is also in the forward's time), with their words.
_WORK = {m.FORWARD: "module forwards", m.BACKWARD: "backward passes", m.OPTIMIZER: "optimizer steps",
         m.SYNC: "device->host syncs", m.DATA_WAIT: "DataLoader fetches", m.DATA_ITER: "DataLoader fetches",
         m.EMPTY_CACHE: "cache releases", m.GC_COLLECT: "gc.collect() calls", m.SAVE: "torch.save calls"}



class Work(msgspec.Struct):
    """One kind of work the probes timed in the stretches, at the user's lines, per stretch:
    `kind` in words ("module forwards"), `count` and `ms` its calls and time per stretch (the
    medians over the stretches), `file` and `lines` where the user's code made them."""

    kind: str
    count: float
    ms: float
    file: str | None = None
    lines: list[int] = []


class Between(msgspec.Struct):
    """The stretches between the audited steps (`Evidence.outside` of phase "between"): how many,
    after which steps, their time in all and each (median), and their share of the span from the
    first step's start to the last one's end (the steps' time and theirs); `steps_per_stretch`, the
    steps run from one stretch to the next (median); `work`, what the probes timed in them, the most
    first."""

    stretches: int
    after_steps: list[int]
    ms: float
    median_ms: float
    share: float
    steps_per_stretch: float | None = None
    work: list[Work] = []


def between(ev: m.Evidence) -> Between | None:
    """The stretches between the steps, or None where a run has none (or no step)."""
    stretches = [o for o in ev.outside if o.phase == "between"]
    steps = [s for s in ev.steps if not s.failed]
    if not stretches or not steps:
        return None
    total = sum(o.ms for o in stretches)
    span = total + sum(s.ms for s in steps)
    after = [o.after_step for o in stretches if o.after_step is not None]
    gaps = [b - a for a, b in zip(after, after[1:])]
    return Between(stretches=len(stretches), after_steps=after, ms=round(total, 3),
                   median_ms=round(median(o.ms for o in stretches), 3), share=round(total / span, 4) if span else 0.0,
                   steps_per_stretch=median(gaps) if gaps else None, work=_work(stretches))


def _work(stretches: list[m.Outside]) -> list[Work]:
    """Each kind of timed work in the stretches, by file: its calls and time per stretch (medians)."""
    per: dict[tuple[str, str | None], list[tuple[int, float]]] = {}
    lines: dict[tuple[str, str | None], set[int]] = {}
    # (`.cpu().numpy()` is one fetch: m.one_fetch)
    for k, t in m.one_fetch([(k, t) for k, o in enumerate(stretches) for t in o.tallies]):
        kind = _WORK.get(t.kind)
        if kind is None:
            continue
        key = (kind, _file(t.where))
        rows = per.setdefault(key, [(0, 0.0)] * len(stretches))
        count, ms = rows[k]
        rows[k] = (count + t.count, ms + t.ms)
        if t.where is not None and t.where.line:
            lines.setdefault(key, set()).add(t.where.line)
    out = [Work(kind=kind, file=file, lines=sorted(lines.get((kind, file), ()))[:6],
                count=median(c for c, _ in rows), ms=round(median(ms for _, ms in rows), 3))
           for (kind, file), rows in per.items()]
    return sorted((w for w in out if w.count > 0), key=lambda w: -w.ms)


def _file(where: Frame | None) -> str | None:
    return where.file if where is not None else None
