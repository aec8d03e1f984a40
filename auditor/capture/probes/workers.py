"""A DataLoader's worker processes, forked by the audited one: what each spends making its batches,
and the plain program's data code inside them.

Each DataLoader with workers gets a slot of MAX_WORKERS cells of (batches, CPU seconds, seconds) in memory
shared with the processes the audited one forks: its workers, started inside its iterator's
__init__ while FORKING names the slot, add each batch they make to their own cell (no two
processes write one: data.py's fetch probe), and the audited process reads the slot's sums at each
batch it fetches (workers_since). Workers started another way (spawn, forkserver) have no probe:
nothing is read. In a forked worker, `forked` takes the audit's own machinery out from around the
program's torch calls.
"""
from __future__ import annotations

import itertools
import types
import weakref
from typing import Any

import torch
import torch.utils.data._utils.fetch as fetch

from auditor.evidence import model as m

FrameKey = tuple[str, int, str] | None

WORKER_SLOTS = 64
MAX_WORKERS = 64
CELLS = 3  # a worker's: batches made, CPU seconds on its thread making them, seconds making them
FORKING = [-1]  # the slot whose workers are being started (as a forked worker finds it)
STARTING = [0]  # > 0 while a DataLoader iterator starts its workers (not the program's own processes)
_SHARED: list[Any] = []  # the shared cells (a memoryview of doubles), made at the first loader with workers
_SLOT_OF: dict[int, int] = {}  # loader_key(loader) -> its slot
_KEYS = itertools.count(1)
GONE_LOADERS: set[int] = set()  # the keys of loaders the program has let go of (freed)


def loader_key(loader: Any) -> int:
    """A key for `loader` that no other loader of the run has (an id is reused once its object is
    freed: a loader rebound to a new one, `train_dl = DataLoader(...)` again, may take the old one's),
    added to GONE_LOADERS when the loader is freed."""
    d = getattr(loader, "__dict__", None)
    if d is None:
        return id(loader)
    key = d.get("_audit_key")
    if key is None:
        key = d["_audit_key"] = next(_KEYS)
        try:
            weakref.finalize(loader, GONE_LOADERS.add, key).atexit = False
        except TypeError:  # (no weak references to it: never taken for gone)
            pass
    return key


def cells() -> Any:
    """The shared cells, made once (before any worker is forked: make_workers_init asks for a slot first)."""
    if not _SHARED:
        import mmap

        _SHARED.append(memoryview(mmap.mmap(-1, WORKER_SLOTS * MAX_WORKERS * CELLS * 8)).cast("d"))
    return _SHARED[0]


def worker_slot(loader: Any) -> int:
    """The loader's slot (-1 past WORKER_SLOTS loaders: not timed)."""
    key = loader_key(loader)
    slot = _SLOT_OF.get(key)
    if slot is None:
        slot = _SLOT_OF[key] = len(_SLOT_OF) if len(_SLOT_OF) < WORKER_SLOTS else -1
        cells()
    return slot


def add_batch(slot: int, worker: int, cpu_s: float, wall_s: float) -> None:
    """One batch a worker made, into its own cell (in the worker; past MAX_WORKERS: not counted)."""
    if worker < MAX_WORKERS:
        shared, i = cells(), (slot * MAX_WORKERS + worker) * CELLS
        shared[i + 2] += wall_s
        shared[i + 1] += cpu_s
        shared[i] += 1.0


def worker_totals(slot: int, workers: int) -> tuple[float, float, float]:
    """(batches, CPU seconds, seconds) of what the slot's first `workers` workers have made so far."""
    if slot < 0:
        return 0.0, 0.0, 0.0
    shared, i = cells(), slot * MAX_WORKERS * CELLS
    end = i + CELLS * min(workers, MAX_WORKERS)
    return sum(shared[i:end:CELLS]), sum(shared[i + 1:end:CELLS]), sum(shared[i + 2:end:CELLS])


def workers_since(rec: Any, it: Any, slot: int, where: FrameKey) -> None:
    """The batches the iterator's workers finished since its last fetch, and their CPU time, as a
    DATA_WORKER tally of the step."""
    workers = getattr(it, "_num_workers", 0) or 0
    batches, cpu, wall = worker_totals(slot, workers)
    seen_batches, seen_cpu, seen_wall = it._audit_seen
    if batches > seen_batches:
        it._audit_seen = (batches, cpu, wall)
        rec.add_sums(m.DATA_WORKER, "DataLoader worker batches", where,
                     (("loader", getattr(it, "_audit_loader_id", 0)), ("workers", workers)),
                     batches=int(batches - seen_batches), cpu_ms=round((cpu - seen_cpu) * 1e3, 3),
                     ms=round((wall - seen_wall) * 1e3, 3))


def forked(wrapped: list[tuple[Any, str, Any]]) -> None:
    """In a DataLoader worker the audited process just forked (its iterator's __init__ starting the
    workers): the program's data code runs there as in a plain run. The recorder is inert in any
    forked child (Recorder._forked), but what the audit put around torch still ran at every call of
    the worker's: the probes' wrappers, the auditor's global module hooks (a torchvision
    `Normalize` is an nn.Module) and torch-function modes (the CUDA rehearsal's: the MNIST
    loader's worker took 2.5x its plain CPU time a batch). They are taken out; kept are the
    fetchers' probes, which time the worker's batches (data.py), and the rehearsal's mode under a
    CUDA default device, whose factories it still puts on the host."""
    if not STARTING[0]:  # (not a DataLoader's worker; past WORKER_SLOTS loaders, one still, though not timed)
        return
    keep = {fetch._MapDatasetFetcher, fetch._IterableDatasetFetcher}
    for owner, name, orig in reversed(wrapped):
        if owner not in keep:
            setattr(owner, name, orig)
    from torch.nn.modules import module as nn_module

    for hooks in (nn_module._global_forward_pre_hooks, nn_module._global_forward_hooks,
                  nn_module._global_backward_pre_hooks, nn_module._global_backward_hooks):
        for key, hook in list(hooks.items()):
            if _auditor_owned(hook):
                hooks.pop(key, None)
    import torch.utils._device as device_ctx

    if device_ctx.CURRENT_DEVICE is not None and device_ctx.CURRENT_DEVICE.type == "cuda":
        return
    modes = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())]
    for mode in reversed(modes):  # (popped top first: pushed back bottom first, the user's own only)
        if not _auditor_owned(mode):
            torch._C._push_on_torch_function_stack(mode)


def _auditor_owned(obj: Any) -> bool:
    """A hook or mode of the auditor's (its function's or class's module is one of the auditor's)."""
    module = (getattr(obj, "__module__", None) if isinstance(obj, (types.FunctionType, types.MethodType))
              else type(obj).__module__)
    return isinstance(module, str) and (module == "auditor" or module.startswith("auditor."))


def process_started(rec: Any, process: Any, where: FrameKey) -> None:
    """A process the program starts itself (not a DataLoader's worker), as a PROCESS_START tally:
    its start method and the function it runs."""
    if STARTING[0]:
        return
    import multiprocessing

    method = getattr(type(process), "_start_method", None) or multiprocessing.get_start_method(allow_none=True)
    target = getattr(process, "_target", None)
    if getattr(target, "__module__", "") == "torch.multiprocessing.spawn":  # (spawn's wrapper: the user's fn first)
        target = next(iter(getattr(process, "_args", ())), target)
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or type(process).__name__
    rec.add(m.PROCESS_START, "multiprocessing.Process.start", where, method=method or "fork", target=str(name))

