"""dataloader-bound: a large share of the step waits for the input pipeline.

A run's half times the waits in DataLoader iteration its probes saw, per step. The trace half
measures DataLoader `__next__` time per ProfilerStep, as a share of the median one.
"""
from __future__ import annotations

import math
import os
from statistics import fmean, median
from typing import Any, Iterable

import msgspec
import numpy as np

from auditor.evidence import model as m
from auditor.evidence.data_supply import worker_supply
from auditor.evidence.trace.decode import CAT
from auditor.evidence.trace.intervals import intersect, merge_intervals, total_length
from auditor.evidence.trace.model import Trace
from auditor.evidence.trace.queries import DATALOADER_NEXT, frame_location_parts, sites
from auditor.findings import Cost, Finding, Fix, Location, share_of_step, step_basis_ms
from auditor.fixes import call_site, computed_kwargs, edit_call_kwargs, edit_mapping, given_elsewhere
from auditor.rules._support.copies import non_blocking_edits
from auditor.rules.base import Option, Options, Rule
from auditor.rules._support.cli_flags import flag_for
from auditor.rules._support.confidence import share_confidence
from auditor.rules._support.stalls import stall_ms, stall_phrase
from auditor.rules._support.frameworks import framework_moves_batches, loader_settings, trains_with


MAX_ADVISED_WORKERS = 8  # the most workers a predicted fix sets: past it, cheaper samples are the fix


def available_cores() -> int:
    """CPU cores this process may run on: its affinity mask (a container's or a job's share of the
    machine), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def recommended_settings(settings: dict[str, Any], on_gpu: bool, cores: int | None = None,
                         threads: int | None = None) -> dict[str, Any]:
    """DataLoader keywords that load batches ahead of the step and differ from the loader's current
    ones: advice to set what is already set is noise, and hides what is really wrong.

    Without workers: as many as the cores allow (2 to 8). With workers that still leave the step
    waiting: more only where the `cores` leave room beside the training process's own `threads`
    (at most twice as many: past the cores, workers only take turns on them).
    """
    cores = cores or available_cores()
    workers = settings.get("num_workers") or 0
    rec: dict[str, Any] = {}
    if not workers:
        rec["num_workers"] = max(2, min(8, cores))
    elif (more := min(2 * workers, cores - (threads or 1))) > workers:
        rec["num_workers"] = more
    if settings.get("persistent_workers") is not True:
        rec["persistent_workers"] = True
    if (settings.get("prefetch_factor") or 2) < 2:
        rec["prefetch_factor"] = 2
    if on_gpu and not settings.get("pin_memory"):
        rec["pin_memory"] = True
    return rec



def step_loader_shares(trace: Trace) -> list[dict[str, Any]]:
    """Per ProfilerStep (or the whole trace when it has none): its ms and the ms inside __next__."""
    # (the rows are picked by name first: a filter of every event copies every column)
    loader = trace.matching(DATALOADER_NEXT)
    loader = loader[loader["cat"].isin((CAT["cpu_op"], CAT["annotation"])) & ~loader["instant"]]
    iv = merge_intervals(loader["ts"].to_numpy(), loader["end"].to_numpy())
    steps = trace.steps
    windows = ([(int(s.step), float(s.ts), float(s.end)) for s in steps.itertuples()] if len(steps)
               else [(-1, *trace.window())])
    out = []
    for number, lo, hi in windows:
        inside = total_length(intersect((np.array([lo]), np.array([hi])), iv))
        out.append({"step": number, "ms": round((hi - lo) / 1000.0, 3), "loader_ms": round(inside / 1000.0, 3),
                    "share": round(inside / (hi - lo), 4) if hi > lo else 0.0})
    return out


def _on_the_gpu(ev: m.Evidence, steps: list[m.StepRecord], measured: bool) -> list[tuple[float, float, float]] | None:
    """For a CUDA program rehearsed on a CPU: each step's (time lost waiting for data, whole step,
    the step without the wait) on the GPU the rehearsal models. The step is the longer of the
    host's least issue time with its waits (step_clock.rehearsed_host_steps) and the kernels'
    estimate; without the wait, of the issue time alone and the kernels': a device-bound step
    waits for its batches while the device still runs the last one's kernels, and loses nothing.
    `measured`: the waits this run measured count (else the workers' time alone). None: not a
    rehearsal, or no kernels estimated."""
    if not ev.environment.rehearsal:
        return None
    from auditor.evidence.step_clock import rehearsed_device_ms, rehearsed_host_steps

    device = rehearsed_device_ms(ev)
    host = rehearsed_host_steps(ev, steps, measured)
    if device is None or not host:
        return None
    out = []
    for wait, issue in host:
        step, rest = max(issue, device[0]), max(issue - wait, device[0])
        out.append((step - rest, step, rest))
    return out


def _workers_source(file: str, line: int, site: Any, passed: list[str] | None) -> str | None:
    """Where the DataLoader call on `line` takes num_workers from when not from a literal it names:
    an expression (`cfg["workers"]`), `**mapping` or its positional arguments (None: a literal, or
    not given at all, the default 0, which a patch adding num_workers replaces)."""
    if site is None:
        return "a call this cannot read"
    if "num_workers" in site.keywords():
        src = computed_kwargs(file, line, ("DataLoader",), ("num_workers",)).get("num_workers")
        return f"`{src}`" if src else None
    return given_elsewhere(site, ("num_workers",), passed).get("num_workers")


class _Waits(msgspec.Struct):
    """The timed steps' waits for data (a rehearsal's: on the GPU it models), as the rule judges them."""
    steps: list[m.StepRecord]
    waits: list[float]
    shares: list[float]  # each step's wait over its own wall time
    cpu_ratio: list[float]  # each step's CPU time over its wall time
    most: float
    loader_ids: dict[Any, Any]  # the loaders the steps waited on, to where
    iter_ms: list[float]
    iter_steps: int
    iter_where: Any
    wait_ms: float
    step_ms: float
    share: float
    per_step_iter: bool
    loader: m.DataLoaderInfo | None
    settings: dict[str, Any]
    workers: int
    supply: Any
    predicted: bool
    gpu: list[tuple[float, float, float]] | None


def _tally_waits(steps: list[m.StepRecord]) -> tuple[float, list[float], dict[Any, Any], list[float], int, Any,
                                                      list[float], list[float]]:
    """Each step's wait for data, the loaders waited on and the iterators made, from the steps' tallies."""

    most, waits, loader_ids, iter_ms, iter_steps, iter_where = 0.0, [], {}, [], 0, None
    shares, cpu_ratio = [], []  # each step's wait over its own wall time; its CPU time over its wall time
    for s in steps:
        wait = sum(t.ms for t in s.tallies if t.kind in (m.DATA_WAIT, m.DATA_ITER))
        made = 0.0
        for t in s.tallies:
            if t.kind == m.DATA_WAIT:
                loader_ids[t.data.get("loader")] = t.where
            elif t.kind == m.DATA_ITER:
                made += t.ms
                if t.what == "DataLoader.__iter__":
                    iter_where = iter_where or t.where
                    loader_ids.setdefault(t.data.get("loader"), t.where)
        iter_steps += any(t.kind == m.DATA_ITER and t.what == "DataLoader.__iter__" for t in s.tallies)
        iter_ms.append(made)
        # (each step's wait over its time less other processes' load, which the wait leaves out)
        own = max(s.ms - (s.waited_ms or 0.0), wait)
        most = max(most, wait / own if own else 0.0)
        waits.append(wait)
        if own:
            shares.append(wait / own)
            if s.cpu_ms is not None:
                cpu_ratio.append(s.cpu_ms / s.ms)
    return most, waits, loader_ids, iter_ms, iter_steps, iter_where, shares, cpu_ratio



class DataloaderBound(Rule):
    """
    What it detects:
        Steps that spend a large share of their time waiting in DataLoader iteration (`__next__`):
        loading in the main process (num_workers=0), too little prefetch, a heavy `__getitem__`,
        or a new iterator every step (`next(iter(loader))`), which starts the workers anew each
        time. The cost is the steps' mean wait per step, as a share of the run's time per step;
        waits that hit some steps only (a slow sample, workers that fall behind) are named as
        stalls. Time the thread was ready to run while another process held the CPU is left out
        (the machine's load, which workers do not take away). On a recorded trace: the time in
        `__next__` over the steps. A CUDA program rehearsed on a CPU is judged on the step the GPU
        would run: it waits wherever its workers take longer to make a step's batches than the
        host takes to issue the step; without workers, its in-step loading is the wait.

    Why it costs:
        With num_workers=0 the model waits while every batch is read, decoded and collated.
        Worker processes prepare the next batches while the current one trains.

    Example:
        bad:   DataLoader(ds, batch_size=64)                               # loads in the step
        good:  DataLoader(ds, batch_size=64, num_workers=4, persistent_workers=True, pin_memory=True)

    Fix:
        Add workers (num_workers ~ free CPU cores), persistent_workers=True, pin_memory=True on a
        GPU with `.to(device, non_blocking=True)` in the step (Lightning's Trainer and Fabric copy
        without blocking themselves); only settings the loader lacks are suggested. When workers
        already load ahead and the step still waits, they cannot keep up: make each sample cheaper
        (batched transforms on whole batches, samples cached or pre-computed), more workers only
        where cores are free. Random augmentations in workers draw from per-worker RNG streams, so
        batches differ from a num_workers=0 run. An IterableDataset whose `__iter__` does not split
        the stream between workers (`get_worker_info()`) must be sharded first; the patch then
        leaves the worker settings out. A setting read from the command line (`--workers`) is left
        to that option: the fix says to run the program with it.

    Evidence needed:
        A run (timed probe on DataLoader iteration, settings captured at DataLoader creation, the
        workers' time a batch) or a profiler trace with DataLoader annotations.
    """

    id = "dataloader-bound"
    title = "The step waits for the input pipeline"
    severity = "warning"
    category = "performance"
    # Judged on any evidence (`needs` names no kind): only a run or a trace holds what it reads, but
    # an audit of a snapshot or a checkpoint runs it (finding nothing) rather than listing it among
    # findings.json's skipped_rules.
    options = (
        Option("min-share", 0.25, "Share of the timed steps' time spent waiting in DataLoader iteration (their "
                                  "waits, stalls included, over their time less other load's) to flag."),
        Option("min-wait-ms", 2.0, "Wait per step below which workers would not pay off (IPC costs ~1 ms)."),
        Option("trace-min-share", 0.25,
               "Trace: report when DataLoader __next__ takes at least this share of the run's time (its time in "
               "the steps over their span)."),
    )

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        yield from self._from_probes(ev, options)
        if ev.trace_data and not ev.steps:  # a recording; a run's probes time every step's data wait
            yield from self.trace_findings(ev, options)

    def trace_findings(self, evidence: m.Evidence, options: Options) -> list[Finding]:
        """One finding per trace whose steps wait on the DataLoader for a large share of their time."""
        findings = []
        threshold = options.trace_min_share
        for trace in evidence.trace_data:
            loader = trace.matching(DATALOADER_NEXT)
            loader = loader[loader["cat"].isin((CAT["cpu_op"], CAT["annotation"]))]
            if not len(loader):
                continue
            per_step = step_loader_shares(trace)
            n = len(per_step)
            loader_ms = sum(s["loader_ms"] for s in per_step)
            step_ms = step_basis_ms(evidence, trace)
            # the run's waits per step, stalls in some steps included: what loading ahead gives back
            waits = [s["loader_ms"] for s in per_step]
            wait_ms = round(loader_ms / n, 3)
            share = share_of_step(wait_ms, step_ms) or 0.0  # (the share every report prints for the cost)
            if share < threshold:
                continue
            shares = [s["share"] for s in per_step]
            names = sorted(set(trace.names(loader)))
            single = any("_SingleProcessDataLoaderIter" in n for n in names)
            where = sites(trace, loader.index.to_numpy(), weights=loader["dur"].to_numpy())
            stalls = stall_phrase(waits)
            message = (("Steps wait for data: load it in DataLoader workers. " if single else
                        "Steps wait for data: the DataLoader's workers do not keep up. ")
                       + f"DataLoader __next__ took {wait_ms:.1f} ms per step in {trace.label} ({share:.0%} of the run's "
                       f"{step_ms:.1f} ms a step; " + (stalls or f"each step's share {min(shares):.0%}-{max(shares):.0%} "
                                                       f"across {n} steps") + ")"
                       + ("; batches are loaded in the training process (num_workers=0)." if single else
                          "; the worker processes cannot keep up."))
            fix = (Fix(summary="Load batches in worker processes: DataLoader(num_workers=4 or more, pin_memory=True, "
                               "persistent_workers=True).",
                       config={"num_workers": 4, "pin_memory": True, "persistent_workers": True})
                   if single else
                   Fix(summary="Give the workers more room: raise num_workers and prefetch_factor, make "
                               "__getitem__ cheaper (pre-decode, cache) or use a faster decoder.",
                       config={"num_workers": 8, "prefetch_factor": 4, "persistent_workers": True}))
            findings.append(self.finding(
                message,
                locations=[Location(*frame_location_parts(f)) for f, _, _ in where],
                evidence={"trace": str(trace.path), "source": "trace",
                          "loader_ms_per_step": wait_ms, "median_loader_ms": round(median(waits), 3),
                          "stall_ms_per_step": stall_ms(waits), "run_step_ms": round(step_ms, 3),
                          "iterator": names, "steps": per_step},
                cost=Cost(ms_per_step=wait_ms, share_of_step=share, measured=True,
                          note="the steps' time inside DataLoader __next__, over the steps"),
                fix=fix,
            ))
        return findings

    def _from_probes(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        # the steps the reported median step is of (Evidence.median_basis: the timed ones): a wait
        # read over other steps (checked, profiled, slowed by another load) can exceed that step
        steps = ev.median_basis()
        w = self._measure(ev, steps, options) if steps else None
        if w is None:
            return
        waits, shares, cpu_ratio, gpu, predicted = w.waits, w.shares, w.cpu_ratio, w.gpu, w.predicted
        loader, settings, workers, supply = w.loader, w.settings, w.workers, w.supply
        stalls = stall_phrase(waits)
        confidence, confidence_text = share_confidence(shares, options.min_share, cpu_ratio)
        cores, threads = available_cores(), ev.environment.num_threads
        rec = recommended_settings(settings, on_gpu=ev.environment.device == "cuda" or ev.environment.rehearsal,
                                   cores=cores, threads=threads)
        needed = None
        rest = median(r for _, _, r in gpu) if gpu is not None else 0.0
        if gpu is not None and predicted:  # (predicted: the workers' supply is known)
            # The workers' CPU time for a step's batches over the rest of the GPU step: how many keep
            # up, each on a core of its own (the GPU machine's cores, which this one does not tell)
            needed = math.ceil(supply.batches_per_step * supply.cpu_ms_per_batch / max(rest, 1e-3))
            rec = {**rec, "num_workers": max(workers + 1, min(needed, MAX_ADVISED_WORKERS))}
        # An IterableDataset that does not split its stream between workers: each worker would
        # yield all of it (every sample num_workers times), so workers are advice with a condition,
        # and the patch, which must leave results unchanged, does not add them.
        unsharded = settings.get("iterable") and not settings.get("shards_by_worker") and "num_workers" in rec
        held_back = ("num_workers", "persistent_workers", "prefetch_factor") if unsharded else ()
        patched = {k: v for k, v in rec.items() if k not in held_back}
        locs, edits, computed, unpacked_note, patched, framework = self._patch(ev, loader, rec, patched, unsharded)
        it_where = w.loader_ids.get(loader.id if loader else None)
        if w.per_step_iter and w.iter_where:
            it_where = w.iter_where
        if it_where:
            locs.append(Location.of(it_where))
        message, summary, note = self._advice(w, rec, needed, rest, cores, threads)
        message, summary, config = self._addenda(ev, w, message, summary, rec, computed, unsharded, unpacked_note,
                                                 framework, stalls)
        message += " " + confidence_text
        fix = Fix(summary=summary, config=config, edits=edits,
                  changes_numerics=bool(edits) and bool({"num_workers", "persistent_workers"} & set(patched)))
        yield self._finding(w, message, fix, note, locs, confidence, cores, threads, needed)

    def _measure(self, ev: m.Evidence, steps: list[m.StepRecord], options: Options) -> _Waits | None:
        """The timed steps' waits for data, where they pass the rule's gates (else None)."""
        most, waits, loader_ids, iter_ms, iter_steps, iter_where, shares, cpu_ratio = _tally_waits(steps)
        # the steps' waits per step (their mean: a stall in one step of eight counts an eighth of it)
        # over the run's time per step: the cost, and the share every report prints for it
        wait_ms, step_ms = round(fmean(waits), 3), step_basis_ms(ev)
        share = share_of_step(wait_ms, step_ms) or 0.0
        # a new iterator in most steps (`next(iter(loader))`): its workers start (and the last
        # one's stop) every step; the fix is to make the iterator once, outside the step
        per_step_iter = iter_steps >= 0.5 * len(steps) and median(iter_ms) > 0.0
        loaders = [d for d in ev.dataloaders if d.id in loader_ids] or ev.dataloaders
        loader = loaders[0] if loaders else None
        settings = loader.settings if loader else {}
        workers = settings.get("num_workers") or 0
        supply = next((x for x in worker_supply(ev, steps) if loader and x.loader == loader.id), None)
        # A CUDA program rehearsed on a CPU is judged on the step it would take on the GPU, which
        # takes the kernels' work off the host (_on_the_gpu): a loader without workers makes its
        # batches in the step, a wait measured here that the GPU keeps; workers make them beside it,
        # and there the step would wait for what their CPU time a step's batches exceeds the host's
        # issue time by (predicted). Where they would keep up, the waits this run measured are judged
        # as on any run (against this CPU's step: a handoff or a read that this machine's load
        # stretched is not set against the GPU's far shorter step).
        # (workers whose batches were not timed, started by spawn: their waits judged as measured)
        predicted = bool(workers and supply is not None and not per_step_iter)
        gpu = _on_the_gpu(ev, steps, measured=not predicted) if predicted or not workers or per_step_iter else None
        if gpu is not None:
            g_waits, g_shares = [w for w, _, _ in gpu], [w / h for w, h, _ in gpu if h > 0]
            if predicted and (not g_shares or median(g_shares) < options.min_share
                              or median(g_waits) < options.min_wait_ms):
                gpu = None
            else:
                waits, shares, cpu_ratio = g_waits, g_shares, []
                most = max(shares, default=0.0)
                wait_ms = round(fmean(waits), 3)
                share = share_of_step(wait_ms, step_ms) or 0.0  # (of the run's time, as every cost's share)
        # The verdict: the steps' waits over their own time, both over the steps the cost is read
        # from (a slow first step or the audit's checks, elsewhere in the run, do not dilute it;
        # stalls in some of them count), their time less what other processes' load took of it
        # (their run-queue delay, which the waits leave out too: like with like); a rehearsal's,
        # the GPU step's own: its wait over the step predicted there. The cost's share printed is
        # of the run's time (above).
        own_ms = sum(max(s.ms - (s.waited_ms or 0.0), w) for s, w in zip(steps, waits))
        judged = (median(shares) if gpu is not None and shares else
                  sum(waits) / own_ms if own_ms > 0 else share)
        # (the run's first fetch starts the loader, and its workers, once: not a wait a step that
        # makes workers worth their hand-over, where the other steps wait less than it)
        first = min(s.index for s in ev.steps)
        later = [w for st, w in zip(steps, waits) if st.index != first] or waits
        if judged < options.min_share or fmean(later) < options.min_wait_ms:
            return None
        return _Waits(steps=steps, waits=waits, shares=shares, cpu_ratio=cpu_ratio, most=most, loader_ids=loader_ids,
                      iter_ms=iter_ms, iter_steps=iter_steps, iter_where=iter_where, wait_ms=wait_ms,
                      step_ms=step_ms, share=share, per_step_iter=per_step_iter, loader=loader,
                      settings=settings, workers=workers, supply=supply, predicted=predicted, gpu=gpu)

    def _patch(self, ev: m.Evidence, loader: m.DataLoaderInfo | None, rec: dict[str, Any], patched: dict[str, Any],
               unsharded: bool) -> tuple[list[Location], list[Any], dict[str, str], str, dict[str, Any], Any]:
        """The edits that set `patched` on the DataLoader call, where the patch may set them."""
        locs = []
        edits = []
        # settings the call takes from an expression (`cfg["num_workers"]`) or through `**mapping`
        computed: dict[str, str] = {}
        unpacked_note = ""
        # a DataLoader the framework built (a Trainer's): its settings are the framework's arguments,
        # given as config; the user's line only calls into the framework, so nothing is edited
        framework = loader_settings(loader.via) if loader else None
        if framework is not None and loader and loader.where:
            locs.append(Location.of(loader.where))
        elif loader and loader.where:
            locs.append(Location.of(loader.where))
            computed = {k: f"`{src}`" for k, src in
                        computed_kwargs(loader.where.file, loader.where.line, ("DataLoader",), patched).items()}
            site = call_site(loader.where.file, loader.where.line, ("DataLoader",))
            if site is not None:  # given through `**mapping` (or by position): set where it is made
                computed.update(given_elsewhere(site, [k for k in patched if k not in computed], loader.passed))
            # a mapping the file builds as a dict literal and only unpacks: the patch sets them in it
            mapped = {k: v for k, v in computed.items() if site is not None and v == f"`{''.join(site.unpacked)}`"}
            if mapped:  # (a dict literal the call unpacks, which gives some: the others go beside them there)
                mapped = {k: mapped.get(k, f"`{''.join(site.unpacked)}`") for k in patched
                          if k in mapped or k not in computed}
            in_mapping = edit_mapping(loader.where.file, loader.where.line, ("DataLoader",),
                                      {k: repr(patched[k]) for k in mapped}) if mapped else None
            if in_mapping:
                edits.append(in_mapping)
                computed = {k: v for k, v in computed.items() if k not in mapped}
                unpacked_note += (" The patch sets " + ", ".join(f"{k}={patched[k]!r}" for k in mapped)
                                  + f" in the dict the call unpacks ({mapped[next(iter(mapped))]}, line "
                                  f"{in_mapping.start}).")
                if "pin_memory" in mapped:  # the step's copies of its batches, as the advice says
                    edits += non_blocking_edits(ev, [loader.id])
            literal = {k: v for k, v in patched.items() if k not in computed and not (in_mapping and k in mapped)}
            # persistent_workers=True and prefetch_factor make DataLoader raise ("needs num_workers > 0")
            # where the call loads in the main process: they go into the patch only beside a num_workers
            # the call names as a literal or the patch sets. One reaching the call through `**mapping` or
            # an expression may be 0 in another configuration (the accelerator's settings, {} on a CPU).
            src = None if in_mapping and "num_workers" in mapped else _workers_source(
                loader.where.file, loader.where.line, site, loader.passed)
            kept_out = [k for k in literal if k in ("persistent_workers", "prefetch_factor")]
            if kept_out and "num_workers" not in literal and src:
                literal = {k: v for k, v in literal.items() if k not in kept_out}
                if not unsharded:
                    unpacked_note += (" " + " and ".join(kept_out) + f" need{'s' if len(kept_out) == 1 else ''} num_workers > 0, which the call takes "
                                      f"from {src}: set {'them' if len(kept_out) > 1 else 'it'} where that is set; "
                                      "the patch leaves " + ("them" if len(kept_out) > 1 else "it") + " out.")
            edit = edit_call_kwargs(loader.where.file, loader.where.line, ("DataLoader",),
                                    {k: repr(v) for k, v in literal.items()}, received=loader.passed) if literal else None
            if edit:
                edits.append(edit)
                if "pin_memory" in literal:  # the step's copies of its batches, as the advice says
                    edits += non_blocking_edits(ev, [loader.id])
                mappings = [u for u in site.unpacked if u.startswith("**")] if site is not None else []
                if mappings and not in_mapping:  # (cst_edits merges the keywords into the last one)
                    unpacked_note += (f" The call also unpacks `{mappings[-1]}`, which gave none of the patch's "
                                      f"keywords in this run: the patch merges them into it (`**dict({mappings[-1][2:].strip()}, "
                                      "...)`), so that where it gives them too (in another configuration) the call "
                                      "gets each once, with the patch's values.")
                elif site is not None and site.unpacked and not in_mapping:
                    unpacked_note += (" The call also passes " + " and ".join(f"`{u}`" for u in site.unpacked)
                                     + ", which gave none of the patch's keywords in this run: where it gives them "
                                     "(in another configuration), the patched call would get them twice.")
            patched = {**literal, **({k: patched[k] for k in mapped} if in_mapping else {})}
        return locs, edits, computed, unpacked_note, patched, framework

    def _advice(self, w: _Waits, rec: dict[str, Any], needed: int | None, rest: float, cores: int,
                threads: int | None) -> tuple[str, str, str]:
        """The finding's message, fix summary and cost note: by who makes the batches and where."""
        gpu, workers, settings, supply, wait_ms, share = w.gpu, w.workers, w.settings, w.supply, w.wait_ms, w.share
        per_step_iter = w.per_step_iter
        rec_text = ", ".join(f"{k}={v!r}" for k, v in rec.items())
        # the training process's threads and the workers share the cores: past them, more workers take turns
        spare = max(0, cores - workers - (threads or 1))
        saturated = workers > 0 and not spare
        note = "most of this overlaps with compute once workers load ahead"
        gpu_step = median(h for _, h, _ in gpu) if gpu is not None else None
        # (the GPU's step and its wait, both of the median predicted step: the cost is the mean)
        gpu_wait = median(w for w, _, _ in gpu) if gpu is not None else None
        if gpu is not None and (needed is not None or not workers):  # (else: workers the run saw fall behind)
            dataset = settings.get("dataset") or "the dataset"
            if needed is not None:  # (the workers' CPU time sets the wait)
                message = ("On the GPU the steps would wait for data: add DataLoader workers. "
                           f"On the GPU this step would take {gpu_step:.2f} ms, {gpu_wait:.2f} ms of it waiting for "
                           f"data (predicted by the CUDA rehearsal): its {workers} worker process"
                           f"{'es take' if workers > 1 else ' takes'} {supply.cpu_ms_per_batch:.2f} ms of CPU "
                           f"to make a batch in `{dataset}`'s `__getitem__`/`__iter__` and the collate, so "
                           f"{'they hand' if workers > 1 else 'it hands'} the step its {supply.batches_per_step:g} "
                           f"batch{'es' if supply.batches_per_step != 1 else ''} in {supply.ms_per_step:.2f} ms at the least, "
                           f"while the rest of the step takes {rest:.2f} ms.")
                summary = (f"Keeping up takes about {needed} workers, each on a core of its own: "
                           f"num_workers={rec['num_workers']}"
                           + (f" (past {MAX_ADVISED_WORKERS}, make each sample cheaper instead: batched transforms on "
                              f"whole batches, samples decoded and cached once)" if needed > MAX_ADVISED_WORKERS else "")
                           + ".")
                others = {k: v for k, v in rec.items() if k != "num_workers"}
                if others:
                    summary += " Also set " + ", ".join(f"{k}={v!r}" for k, v in others.items()) + "."
            else:
                message = ("Steps wait for data: load it in DataLoader workers. "
                           f"The steps wait {wait_ms:.1f} ms a step for data with num_workers={settings.get('num_workers')}, "
                           f"pin_memory={settings.get('pin_memory')}: on the GPU, which takes the kernels' work off "
                           f"the host but not the loading, that is {gpu_wait:.2f} of the {gpu_step:.2f} ms it would "
                           f"take (predicted by the CUDA rehearsal).")
                summary = ("Load batches in worker processes ahead of the step: " + rec_text + "."
                           if not workers else f"Set {rec_text}." if rec else "")
            note = ("predicted: the step's wait for its batches on the GPU the CUDA rehearsal models"
                    if needed is not None else "the step's wait for its batches, measured; on the GPU, all of the step's time it adds")
        elif workers and not per_step_iter:
            # Workers exist, are kept and load ahead, and the step still waits: they cannot keep
            # up. Repeating their settings back ("persistent_workers=True") would say nothing.
            dataset = settings.get("dataset") or "the dataset"
            message = ("Steps wait for data its workers cannot make in time: make samples cheaper. "
                       f"The steps wait {wait_ms:.1f} ms a step for data ({share:.0%} of the run's time) although "
                       f"{workers} worker processes load ahead (prefetch_factor={settings.get('prefetch_factor')}, "
                       f"persistent_workers={settings.get('persistent_workers')}): the workers cannot keep up. "
                       f"Each makes its samples one at a time in `{dataset}`'s `__getitem__`/`__iter__`, more slowly "
                       f"than the step uses them"
                       + (f", and the CPU has no core to spare: {cores} core(s) for {workers} workers and the "
                          f"training process's {threads or 1} thread(s)." if saturated else ".")
                       + (f" A batch takes a worker {supply.ms_per_batch:.2f} ms, {supply.cpu_ms_per_batch:.2f} ms of "
                          f"it on the CPU (timed in the workers; the rest is waiting: reads, sleeps, other "
                          f"processes on its core)." if supply is not None else ""))
            summary = (f"The workers cannot keep up: make each sample cheaper. Move per-sample work out of "
                       f"`{dataset}.__getitem__`/`__iter__` into batched transforms on whole batches (after "
                       f"collation, or on the device), and cache or pre-compute what does not change between "
                       f"epochs (decoded, resized samples).")
            if "num_workers" in rec:
                summary += f" With {cores} cores here, num_workers={rec['num_workers']} also helps."
            elif saturated:
                summary += (f" More workers would only take turns on the {cores} core(s) here, which the "
                            f"workers and the training process already fill.")
            others = {k: v for k, v in rec.items() if k != "num_workers"}
            if others:
                summary += " Also set " + ", ".join(f"{k}={v!r}" for k, v in others.items()) + "."
            note = "the step's wait for batches its workers have not finished yet"
        else:
            message = (("Steps wait for data: load it in DataLoader workers. " if not workers else
                        "Steps wait for data: change the DataLoader's settings. ")
                       + f"The steps wait {wait_ms:.1f} ms a step for data ({share:.0%} of the run's time) with "
                       f"num_workers={settings.get('num_workers')}, pin_memory={settings.get('pin_memory')}.")
            summary = ("Load batches in worker processes ahead of the step: " + rec_text + "."
                       if not workers else f"Set {rec_text}." if rec else "")
        return message, summary, note

    def _addenda(self, ev: m.Evidence, w: _Waits, message: str, summary: str, rec: dict[str, Any],
                 computed: dict[str, str], unsharded: bool, unpacked_note: str, framework: dict[str, str] | None,
                 stalls: str | None) -> tuple[str, str, dict[str, Any]]:
        """The message and summary with what the loader's kind, call and steps add to them; the config."""
        loader, settings, workers, per_step_iter = w.loader, w.settings, w.workers, w.per_step_iter
        iter_steps, iter_ms, iter_where, steps = w.iter_steps, w.iter_ms, w.iter_where, w.steps
        if unsharded:
            dataset = settings.get("dataset") or "the dataset"
            summary += (f" But `{dataset}` is an IterableDataset whose `__iter__` does not split the stream "
                        f"between workers: with num_workers={rec['num_workers']} each worker would yield all of "
                        f"it, every sample {rec['num_workers']} times. Shard it first (in `__iter__`, by "
                        f"`torch.utils.data.get_worker_info()`: id and num_workers); the patch leaves the "
                        f"worker settings out.")
        if computed:  # a patch hard-coding them would leave the config entry dead
            # (read from the program's command line: the fix is its option, `--workers 8`)
            flags = ({k: flag_for(loader.where.file, src) for k, src in computed.items()}
                     if loader and loader.where else {})
            summary += (" The call takes " + ", ".join(f"{k} from {src}" + (f", the command line's {flags[k]}"
                                                                                if flags.get(k) else "")
                                                       for k, src in computed.items())
                        + ": " + ", ".join(f"run it with {flags[k]} {rec[k]!r}" if flags.get(k) else
                                           f"set {k}={rec[k]!r} there" for k in computed)
                        + "; the patch leaves " + ("it" if len(computed) == 1 else "them") + " alone.")
        if "pin_memory" in rec:  # (under Lightning, it makes the copy: frameworks.framework_moves_batches)
            fabric = framework_moves_batches(trains_with([loader.where.file if loader and loader.where else None, ev.target]))
            summary += (f" {fabric[0].upper()}{fabric[1:]}." if fabric else
                        " Copy the pinned batches with .to(device, non_blocking=True), so the copy overlaps compute.")
        summary += unpacked_note
        if per_step_iter:
            message += (f" A new DataLoader iterator is made in {iter_steps} of {len(steps)} steps"
                        + (f" at line {iter_where.line}" if iter_where else "")
                        + f" ({median(iter_ms):.1f} ms a step"
                        + (f", starting its {workers} worker processes each time" if workers else "") + ").")
            summary = ("Make the iterator once, outside the step (`it = iter(loader)` at module level, then "
                       "`next(it)` in the step, re-made at StopIteration), so its workers start once. "
                       + summary).rstrip()
        config = {f"DataLoader.{k}": v for k, v in rec.items()}
        if framework is not None:
            config = {framework.get(k, f"DataLoader.{k}"): v for k, v in rec.items()}
            named = [f"{framework[k]}={v!r}" for k, v in rec.items() if k in framework]
            message += (" The framework built this DataLoader from its own arguments"
                        + (f" ({', '.join(framework[k].split('.')[-1] + '=' + repr(settings.get(k)) for k in rec if k in framework)})"
                           if named else "") + ".")
            if named:
                summary += " Set them in the framework: " + ", ".join(named) + "."
        if stalls:  # (waits that hit some steps: a slow sample, or workers that fall behind)
            message += f" Most of it in stalls: {stalls}."
            if workers and not per_step_iter:
                summary += (f" The stalls are batches the workers had not finished when the step asked: a slow "
                            f"sample, or too few batches ready (prefetch_factor={settings.get('prefetch_factor')}, "
                            f"{workers} workers); find the slow samples (the stalled steps' indices) and make them "
                            "cheaper, or raise prefetch_factor so more batches wait ready.")
        return message, summary, config

    def _finding(self, w: _Waits, message: str, fix: Fix, note: str, locs: list[Location], confidence: dict[str, Any],
                 cores: int, threads: int | None, needed: int | None) -> Finding:
        waits, wait_ms, share, step_ms, most, gpu, supply = w.waits, w.wait_ms, w.share, w.step_ms, w.most, w.gpu, w.supply
        settings, workers, per_step_iter, iter_steps, iter_ms = w.settings, w.workers, w.per_step_iter, w.iter_steps, w.iter_ms
        # the training process's threads and the workers share the cores: past them, more workers take turns
        spare = max(0, cores - workers - (threads or 1))
        gpu_step = median(h for _, h, _ in gpu) if gpu is not None else None
        return self.finding(
            message,
            locations=list(dict.fromkeys(locs)),
            evidence={"wait_ms_per_step": round(wait_ms, 3), "median_wait_ms": round(median(waits), 3),
                      "stall_ms_per_step": stall_ms(waits), "run_step_ms": round(step_ms, 3) if step_ms else None,
                      **confidence,
                      "max_share": round(most, 4), "settings": settings,
                      "iterator_per_step": per_step_iter, "steps_making_an_iterator": iter_steps,
                      "median_iterator_ms": round(median(iter_ms), 3),
                      "cpu_cores": cores, "torch_threads": threads, "spare_cores": spare,
                      **({"predicted_gpu_step_ms": round(gpu_step, 3)} if gpu_step is not None else {}),
                      **({"worker_cpu_ms_per_batch": supply.cpu_ms_per_batch, "worker_batches": supply.batches,
                          "worker_ms_per_batch": supply.ms_per_batch,
                          "workers_ms_per_step": supply.ms_per_step} if supply is not None else {})},
            # (a rehearsal's wait for what its workers cannot make in time is predicted; its loading in
            # the step is measured, as on any run)
            cost=Cost(ms_per_step=round(wait_ms, 3), share_of_step=share, measured=gpu is None or needed is None, note=note),
            # Workers change what a Dataset computes: each draws its random augmentations from its
            # own seed (and persistent workers keep theirs across epochs), and state a Dataset builds
            # in __getitem__ is per worker. So such an edit is marked as one that changes results.
            fix=fix,
        )
