"""How fast a DataLoader's worker processes can hand a step its batches.

Each worker makes whole batches, one at a time, on a core of its own: a batch costs it the CPU time
its fetch took (the dataset's `__getitem__`/`__iter__` and the collate_fn, timed on the worker's own
thread: the `data-worker` tallies, auditor.evidence.model.DATA_WORKER; what a worker waits for, a
read or a sleep, is not counted, so the supply is a bound). With W workers the loader
hands out at most one batch every (CPU ms a batch) / W, however fast the step runs: a step that
fetches B batches of it lasts at least B x that. On the machine that ran the audit the step is
usually the slower of the two; on a GPU, which takes the step's kernels off the host, the workers
may be what the step waits for (a CUDA program rehearsed on a CPU: step_clock).
"""
from __future__ import annotations

from statistics import median
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from auditor.evidence.model import Evidence, StepRecord


class Supply(msgspec.Struct, frozen=True):
    """One DataLoader's workers, as the run measured them."""

    loader: int  # the DataLoader's id (evidence.dataloaders[].id)
    workers: int
    batches: int  # the batches the workers made over the run's steps
    cpu_ms_per_batch: float  # a worker's CPU time a batch (the median over the steps that got one)
    ms_per_batch: float  # its time a batch, waits included (reads, sleeps, other processes on its core)
    batches_per_step: float  # the batches a step fetches from it (the median over the steps)
    ms_per_step: float  # the least time the workers take to make a step's batches: what a step lasts at least


def worker_supply(ev: Evidence, steps: list[StepRecord] | None = None) -> list[Supply]:
    """The loaders with workers whose batches the run timed, slowest supply first. `steps`: those
    whose fetches count (the median basis by default); the workers' time is read over every step."""
    from auditor.evidence import model as m

    per_batch: dict[int, list[float]] = {}
    wall: dict[int, list[float]] = {}
    made: dict[int, int] = {}
    workers: dict[int, int] = {}
    for s in ev.steps:
        for t in s.tallies:
            if t.kind != m.DATA_WORKER or not t.data.get("batches"):
                continue
            loader = t.data.get("loader", 0)
            per_batch.setdefault(loader, []).append(t.data.get("cpu_ms", 0.0) / t.data["batches"])
            wall.setdefault(loader, []).append(t.data.get("ms", 0.0) / t.data["batches"])
            made[loader] = made.get(loader, 0) + int(t.data["batches"])
            workers[loader] = int(t.data.get("workers") or 0)
    out = []
    basis = steps if steps is not None else ev.median_basis()
    for loader, ratios in per_batch.items():
        if workers[loader] <= 0:
            continue
        fetched = [sum(t.count for t in s.tallies if t.kind == m.DATA_WAIT and t.data.get("loader") == loader
                       and not t.data.get("exhausted")) for s in basis]
        per_step = median(fetched) if fetched else 0.0
        if per_step <= 0:
            continue
        cpu = median(ratios)
        out.append(Supply(loader=loader, workers=workers[loader], batches=made[loader],
                          cpu_ms_per_batch=round(cpu, 3), ms_per_batch=round(median(wall[loader]), 3),
                          batches_per_step=per_step,
                          ms_per_step=round(per_step * cpu / workers[loader], 3)))
    return sorted(out, key=lambda x: -x.ms_per_step)
