"""Probes on the input pipeline: each DataLoader's settings where it was made (and the framework
code that made it), the step's waits for batches and for new iterators' workers, and each
DistributedSampler epoch (whether `set_epoch` was called). Installed by `probes.install()` with
its recorder and its wrapper (this module imports nothing of the probes package: no import cycle)."""
from __future__ import annotations

import sys
import time
import weakref
from typing import Any, Callable

import torch
import torch.utils.data._utils.fetch as fetch
import torch.utils.data.dataloader as dl
from torch.utils.data import get_worker_info

from auditor.capture import own_time, run_queue
from auditor.capture.frames import is_library, is_torch_internal, library_via, user_frame
from auditor.capture.probes.workers import (FORKING, STARTING, add_batch, loader_key, process_started,
                                           worker_slot, worker_totals, workers_since)
from auditor.evidence import model as m

perf = time.perf_counter
thread_time = time.thread_time
FrameKey = tuple[str, int, str] | None
Wrap = Callable[[Any, str, Callable[[Callable], Callable]], None]


# --- DataLoader --------------------------------------------------------------------------------

DATALOADER_SETTINGS = ("batch_size", "num_workers", "pin_memory", "persistent_workers", "prefetch_factor",
                       "drop_last", "timeout")


def _shards_by_worker(dataset: Any, worker_init_fn: Any) -> bool:
    """Whether an IterableDataset splits its stream between workers: its `__iter__` asks
    `get_worker_info()`, or a `worker_init_fn` is given (where sharding is commonly set up).
    Without either, every worker yields the whole stream: num_workers=4 repeats each sample 4x,
    so workers are no fix to recommend blindly. Only the user's own classes are judged: a
    library's stream (webdataset, datasets) shards in code this cannot read, and is taken to."""
    if worker_init_fn is not None:
        return True
    import inspect

    try:
        file = inspect.getsourcefile(type(dataset))
        if not file or is_library(file):
            return True
        return "get_worker_info" in inspect.getsource(type(dataset).__iter__)
    except (OSError, TypeError):
        return True  # (no source to read: not claimed unsharded)


def _passed(init: Callable, self: Any, args: tuple, kwargs: dict) -> list[str] | None:
    """The parameters a DataLoader(...) call gave, by position, by name or through `**mapping`:
    a fix adding one of them as a keyword would make the call raise "got multiple values"."""
    import inspect

    try:
        bound = inspect.signature(init).bind_partial(self, *args, **kwargs).arguments
    except (TypeError, ValueError):
        return None
    return sorted(k for k in bound if k != "self")


def install_dataloader_probes(REC: Any, _wrap: Wrap) -> None:
    """Probe the DataLoader for the recorder `REC`, wrapping with the probes' `_wrap`."""
    import multiprocessing.process

    _wrap(multiprocessing.process.BaseProcess, "start", _process_start(REC))
    for fetcher in (fetch._MapDatasetFetcher, fetch._IterableDatasetFetcher):
        _wrap(fetcher, "fetch", _worker_fetch(REC))
    _wrap(dl.DataLoader, "__init__", _loader_made(REC))
    # iter(loader) starts a multiprocessing iterator's workers (a process each): in a step
    # (`next(iter(loader))`) that is paid every step
    _wrap(dl.DataLoader, "__iter__", _timed_in_data(
        REC, m.DATA_ITER, "DataLoader.__iter__",
        lambda loader: {"loader": loader_key(loader), "workers": getattr(loader, "num_workers", 0) or 0},
        outermost_only=True))
    _wrap(dl._BaseDataLoaderIter, "__init__", _iterator_made)
    _wrap(dl._MultiProcessingDataLoaderIter, "__init__", _workers_started(REC))
    _wrap(dl._BaseDataLoaderIter, "__next__", _timed_in_data(
        REC, m.DATA_WAIT, "DataLoader.__next__", lambda it: {"loader": getattr(it, "_audit_loader_id", 0)},
        outermost_only=False))
    _wrap(dl._MultiProcessingDataLoaderIter, "_shutdown_workers", _workers_shut_down(REC))


def _loader_made(REC: Any) -> Callable[[Callable], Callable]:
    """DataLoader(...): its settings, where it was made (and by which library code), what it was given."""
    def make(orig):
        def probe(self, *args, **kwargs):
            orig(self, *args, **kwargs)
            rec = REC
            key = loader_key(self) if rec.active else None
            if key is not None and not any(d["id"] == key for d in rec.dataloaders):
                settings = {k: getattr(self, k, None) for k in DATALOADER_SETTINGS}
                settings["dataset"] = type(self.dataset).__name__
                settings["default_collate"] = self.collate_fn is dl.default_collate
                if isinstance(self.dataset, torch.utils.data.IterableDataset):
                    settings["iterable"] = True
                    settings["shards_by_worker"] = _shards_by_worker(self.dataset, self.worker_init_fn)
                try:
                    settings["batches"] = len(self)
                except TypeError:
                    pass
                where = user_frame(sys._getframe(1))
                rec.dataloaders.append({"id": key, "where": where, "settings": settings, "sent": False,
                                        "via": library_via(sys._getframe(1)), "passed": _passed(orig, self, args, kwargs)})
        return probe
    return make


def _iterator_made(orig: Callable) -> Callable:
    """An iterator of a DataLoader: it keeps its loader's key."""
    def probe(self, loader, *args, **kwargs):
        self._audit_loader_id = loader_key(loader)
        return orig(self, loader, *args, **kwargs)
    return probe


def _workers_started(REC: Any) -> Callable[[Callable], Callable]:
    """A multiprocessing iterator starting its workers: they time their batches into the loader's slot."""
    def make(orig):
        def probe(self, loader, *args, **kwargs):
            if not REC.active:
                return orig(self, loader, *args, **kwargs)
            # the workers this starts (forked inside orig) time their batches into the loader's slot
            slot = worker_slot(loader)
            self._audit_slot, self._audit_seen = slot, worker_totals(slot, loader.num_workers)
            FORKING[0] = slot
            STARTING[0] += 1
            try:
                return orig(self, loader, *args, **kwargs)
            finally:
                FORKING[0] = -1
                STARTING[0] -= 1
        return probe
    return make


def _timed_in_data(REC: Any, kind: str, what: str, data_of: Callable[[Any], dict], outermost_only: bool):
    """DataLoader work the step waits for, timed at the user's line; calls made inside it are the
    loader's own (in_data), not the step's. A call that ends in StopIteration (the epoch is over)
    returned no batch: its time is waited all the same, but it is tallied apart (exhausted=True),
    so a tally's count is of batches returned. The auditor's own work inside the call (own_time:
    the rehearsal's) is no wait of the program's and is taken out; in a call without it, so is the
    time the thread was ready while another process held the CPU (run_queue). (A rehearsal's own
    time is clocked on the wall, and holds its share of that load already.)"""
    def make(orig):
        def probe(self):
            rec = REC
            if not rec.active or (outermost_only and rec.in_data):
                return orig(self)
            f = sys._getframe(1)
            rec.in_data += 1
            t0, own0, queued0 = perf(), own_time.spent(), run_queue.waited_ms()
            ended = {}
            try:
                return orig(self)
            except StopIteration:
                ended = {"exhausted": True}
                raise
            finally:
                rec.in_data -= 1
                wall_ms, own_ms = (perf() - t0) * 1e3, (own_time.spent() - own0) * 1e3
                queued1 = run_queue.waited_ms()
                queued = queued1 - queued0 if queued0 is not None and queued1 is not None else 0.0
                ms = wall_ms - (own_ms if own_ms > 0 else queued)
                where = user_frame(f)
                rec.add(kind, what, where, max(ms, 0.0), **data_of(self), **ended)
                slot = getattr(self, "_audit_slot", None)
                if slot is not None:  # (a multiprocessing iterator's __next__)
                    workers_since(rec, self, slot, where)
        return probe
    return make


def _workers_shut_down(REC: Any) -> Callable[[Callable], Callable]:
    """An iterator dropped before its end joins its workers (in __del__, at the user's line that
    dropped it); at an epoch's end this runs inside __next__, already timed there."""
    def make(orig):
        def probe(self, *args, **kwargs):
            rec = REC
            if not rec.active or rec.in_data or getattr(self, "_shutdown", True):
                return orig(self, *args, **kwargs)
            t0 = perf()
            try:
                return orig(self, *args, **kwargs)
            finally:
                rec.add(m.DATA_ITER, "DataLoader worker shutdown", user_frame(sys._getframe(1)),
                        (perf() - t0) * 1e3, loader=getattr(self, "_audit_loader_id", 0),
                        workers=getattr(self, "_num_workers", 0) or 0)
        return probe
    return make


def _worker_fetch(REC: Any) -> Callable[[Callable], Callable]:
    """In a worker (forked while FORKING named its loader's slot): the fetch's time, and its CPU
    time on the worker's own thread (the dataset's __getitem__/__iter__ and the collate_fn), into
    its cell (workers.add_batch)."""
    def make(orig):
        def probe(self, possibly_batched_index):
            slot = FORKING[0]
            if slot < 0 or REC.active:  # (the audited process itself: num_workers=0, or not a worker)
                return orig(self, possibly_batched_index)
            info = get_worker_info()
            if info is None:
                return orig(self, possibly_batched_index)
            t0, w0 = thread_time(), perf()
            batch = orig(self, possibly_batched_index)  # (StopIteration: no batch, not counted)
            add_batch(slot, info.id, thread_time() - t0, perf() - w0)
            return batch
        return probe
    return make


def _process_start(REC: Any) -> Callable[[Callable], Callable]:
    """A process the program starts itself (its own code's `Process(...).start()`, or
    torch.multiprocessing.spawn's): what it runs is outside the audit (the summary says so); not
    the processes libraries start for their own work (a Pool's, torch.compile's workers)."""
    def make(orig):
        def probe(self, *args, **kwargs):
            rec = REC
            if rec.active and not rec.in_data:
                f = sys._getframe(1)
                code = f.f_code
                if not is_library(code.co_filename) or (code.co_name in ("start_processes", "start_process")
                                                        and is_torch_internal(code.co_filename)):
                    process_started(rec, self, user_frame(f))
            return orig(self, *args, **kwargs)
        return probe
    return make


# --- DistributedSampler ----------------------------------------------------------------------

def install_sampler_probes(REC: Any, _wrap: Wrap) -> None:
    """A DistributedSampler shuffles each epoch with `seed + epoch`: iterated again without
    `set_epoch`, it repeats its order. Its `__iter__` runs once per epoch (when the DataLoader
    fetches the epoch's first indices), so recording each start costs nothing per step. The tally
    keeps the epoch it used, whether it shuffles, where the sampler was made, and whether the
    previous iteration ran to its end (`next(iter(loader))` to peek at a batch is no epoch): the
    index iterator `__iter__` returned is kept (weakly keyed by the sampler; an exhausted list
    iterator holds nothing) and asked how much it has left."""
    from operator import length_hint

    from torch.utils.data.distributed import DistributedSampler

    made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    last: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def caller(self: Any, name: str) -> FrameKey:
        # the line that made or iterated the sampler, past a subclass's own __init__/__iter__
        f = sys._getframe(2)
        while f is not None and f.f_code.co_name == name and f.f_locals.get("self") is self:
            f = f.f_back
        return user_frame(f)

    def make_init(orig):
        def probe(self, *args, **kwargs):
            orig(self, *args, **kwargs)
            if REC.active:
                try:
                    made[self] = caller(self, "__init__")
                except TypeError:  # (unhashable, or no weak references: not followed)
                    pass
        return probe

    def make_iter(orig):
        def probe(self):
            rec = REC
            if not rec.active:
                return orig(self)
            weak = _weakable(self)
            where = made.get(self) if weak else None
            prev = last.get(self) if weak else None
            left = -1 if prev is None else length_hint(prev, -1)
            epoch = getattr(self, "epoch", None)
            rec.add(m.SAMPLER_ITER, f"{type(self).__name__}.__iter__", caller(self, "__iter__"),
                    sampler=id(self), epoch=epoch if isinstance(epoch, int) else repr(epoch),
                    shuffle=bool(getattr(self, "shuffle", False)),
                    made_file=where[0] if where else None, made_line=where[1] if where else None,
                    prev_finished=None if left < 0 else left == 0)
            it = orig(self)
            if weak:
                last[self] = it
            return it
        return probe

    _wrap(DistributedSampler, "__init__", make_init)
    _wrap(DistributedSampler, "__iter__", make_iter)


def _weakable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
        hash(obj)
        return True
    except TypeError:
        return False
