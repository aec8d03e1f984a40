"""worker-restarts: a DataLoader's worker processes stop and start again at every epoch."""
from __future__ import annotations

from statistics import median
from typing import Iterable

from auditor.evidence import model as m
from auditor.evidence.run_time import run_time
from auditor.findings import Cost, Finding, Fix, Location, share_of_step, step_basis_ms
from auditor.fixes import edit_call_kwargs
from auditor.rules.base import Option, Options, Rule


class WorkerRestarts(Rule):
    """
    What it detects:
        The training DataLoader has worker processes (num_workers > 0) without
        `persistent_workers=True`, and a new iterator of it is made between the steps (a `for`
        over it at every epoch): the last epoch's workers are stopped (joined) when it runs out,
        and new ones are started (forked, each importing and building its copy of the dataset)
        before the epoch's first batch. Its cost is that time in the run: the stretches between
        the steps in which the loader ended one epoch and began the next, and the first step of
        each epoch's wait past the steps' median wait, over the run's steps.

    Why it costs:
        Starting a worker process costs tens to hundreds of milliseconds (a fork, the dataset
        copied or rebuilt, its first batches made before the step gets one), and stopping them
        joins each. With short epochs (8 batches), that comes every 8 steps: on a 2-core machine
        ~60-130 ms an epoch against ~5 ms steps.

    Example:
        bad:   loader = DataLoader(ds, batch_size=8, num_workers=2)
               for epoch in range(epochs):
                   for x, y in loader: ...
        good:  loader = DataLoader(ds, batch_size=8, num_workers=2, persistent_workers=True)

    Fix:
        `persistent_workers=True`: the workers stay up from one epoch to the next, and begin the
        next epoch's batches when its iterator is made. The patch (marked as changing results: each
        worker's random stream then runs on across epochs, so augmentations differ from a run that
        reseeds them every epoch) adds it to the DataLoader call.

    Evidence needed:
        A run whose steps cross at least one epoch boundary: the probes time the loader's new
        iterator (`DataLoader.__iter__`), the fetch that ran out (which stops the workers) and the
        stretch between the steps they are in.
    """

    id = "worker-restarts"
    title = "DataLoader workers stop and start again every epoch"
    severity = "warning"
    saves_on = "step"
    category = "performance"
    needs = frozenset({"run"})
    needs_text = "needs a run whose steps cross an epoch of a DataLoader with workers"
    options = (
        Option("min-share", 0.05, "Share of the run's time the workers' stops and starts take, to flag."),
    )

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        account = run_time(ev)
        if account is None or account.source != "run":
            return
        waits = {s.index: sum(t.ms for t in s.tallies if t.kind in (m.DATA_WAIT, m.DATA_ITER)) for s in ev.steps}
        usual = median(waits.values()) if waits else 0.0
        training = {t.data.get("loader") for s in ev.steps for t in s.tallies if t.kind == m.DATA_WAIT}
        first, last = min(waits), max(waits)
        for loader in ev.dataloaders:
            settings = loader.settings
            if loader.id not in training or not settings.get("num_workers") or settings.get("persistent_workers"):
                continue
            starts = [o for o in ev.outside if o.phase == "between" and o.after_step is not None
                      and first <= o.after_step < last and _starts_epoch(o, loader.id)]
            if not starts:
                continue
            between = sum(_epoch_ms(o, loader.id) for o in starts)
            first_waits = sum(max(0.0, waits.get(o.after_step + 1, usual) - usual) for o in starts)  # type: ignore[operator]
            ms = round((between + first_waits) / account.steps, 3)
            share = share_of_step(ms, step_basis_ms(ev)) or 0.0
            if share < options.min_share:
                continue
            yield self._finding(ev, loader, starts, between, first_waits, ms, share)

    def _finding(self, ev: m.Evidence, loader: m.DataLoaderInfo, starts: list[m.Outside], between: float,
                 first_waits: float, ms: float, share: float) -> Finding:
        workers = loader.settings.get("num_workers")
        each = (between + first_waits) / len(starts)
        after = ", ".join(str(o.after_step) for o in starts[:6]) + (", ..." if len(starts) > 6 else "")
        message = ("DataLoader workers restart each epoch: set persistent_workers=True. "
                   f"Its {workers} workers stop and start again at each of {len(starts)} epoch starts (after steps "
                   f"{after}), {each:.1f} ms each: {ms:.2f} ms a step ({share:.0%} of the run's time).")
        iter_at = next((t.where for o in starts for t in o.tallies
                        if t.kind == m.DATA_ITER and t.what == "DataLoader.__iter__" and t.where), None)
        locations = [Location.of(w) for w in (loader.where, iter_at) if w is not None]
        edits = []
        if loader.where is not None and "persistent_workers" not in (loader.passed or []):
            edit = edit_call_kwargs(loader.where.file, loader.where.line, ("DataLoader",),
                                    {"persistent_workers": "True"}, received=loader.passed)
            edits = [edit] if edit is not None else []
        return self.finding(
            message, locations=list(dict.fromkeys(locations)),
            evidence={"loader": loader.id, "workers": workers, "epoch_starts": len(starts),
                      "after_steps": [o.after_step for o in starts], "between_ms": round(between, 3),
                      "first_step_waits_ms": round(first_waits, 3), "ms_per_epoch_start": round(each, 3)},
            cost=Cost(ms_per_step=ms, share_of_step=share, measured=True,
                      note="the workers' stops and starts between the steps and the epochs' first waits, measured"),
            fix=Fix(summary="Keep the workers from one epoch to the next: DataLoader(..., persistent_workers=True).",
                    config={"DataLoader.persistent_workers": True}, edits=edits, changes_numerics=bool(edits)))


def _starts_epoch(o: m.Outside, loader: int) -> bool:
    """Whether the stretch made a new iterator of `loader` (its epoch's `for`)."""
    return any(t.kind == m.DATA_ITER and t.what == "DataLoader.__iter__" and t.data.get("loader") == loader
               for t in o.tallies)


def _epoch_ms(o: m.Outside, loader: int) -> float:
    """The stretch's time the epoch's end and start took: all of it where the loader's calls are the
    only work timed there (its old workers' teardown runs in the iterator's finaliser, untimed),
    else the loader's own calls."""
    mine = [t for t in o.tallies if t.kind in (m.DATA_WAIT, m.DATA_ITER) and t.data.get("loader") == loader]
    others = [t for t in o.tallies if t.ms > 0 and t not in mine]
    return o.ms if not others else min(o.ms, sum(t.ms for t in mine))
