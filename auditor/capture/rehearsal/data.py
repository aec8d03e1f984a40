"""CUDA rehearsal, the DataLoader side: which batches come out pinned, and which already on the GPU.

A CPU-only torch cannot pin memory, so `DataLoader(pin_memory=True)` skips its pinning step (torch
asks `torch.accelerator.is_available()`, which tells torch's own callers the truth) and would hand
out ordinary batches. The rehearsal runs that step itself, as torch's pin-memory step does on a GPU:
each batch goes through `torch.utils.data._utils.pin_memory.pin_memory`, whose `Tensor.pin_memory()`
calls the rehearsal answers -- host tensors come back remembered as pinned, so `pageable-copy` does
not blame their copies, and a tensor meant for the GPU is refused as a GPU refuses it ("cannot pin
'torch.cuda.FloatTensor' ..."), e.g. a dataset made under `set_default_device("cuda")`. It also
records a `device-batch` tally when a batch comes out holding tensors meant for the GPU, for
`dataloader-on-device`. Each batch tensor also remembers its loader, so a later copy can name the
DataLoader that should pin it.

These wrappers go in before the probes', which then wrap them: the probes' `in_data` count is up
while they run.
"""
from __future__ import annotations

import functools
import sys
import threading
import time
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch
import torch.utils.data.dataloader as dl
from torch._utils import ExceptionWrapper
from torch.utils.data._utils.pin_memory import pin_memory as _pin_batch

from auditor.capture import own_time, probes
from auditor.capture.probes.workers import loader_key
from auditor.capture.rehearsal import clock
from auditor.capture.rehearsal.call_sites import call_site
from auditor.capture.rehearsal.device import CUDA_MARK, LOADER_MARK, PINNED_MARK
from auditor.evidence import model as m


def batch_tensors(batch: Any, depth: int = 4) -> Iterator[torch.Tensor]:
    """The tensors of a batch as default_collate builds them: nested tuples, lists, dicts."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif depth and isinstance(batch, Mapping):
        for v in batch.values():
            yield from batch_tensors(v, depth - 1)
    elif depth and isinstance(batch, (list, tuple)):
        for v in batch:
            yield from batch_tensors(v, depth - 1)


def _wrap(owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    orig = getattr(owner, name)
    if getattr(orig, "__rehearsal_original__", None) is not None:
        return
    new = make(orig)
    functools.update_wrapper(new, orig)
    new.__rehearsal_original__ = orig  # not probes' __audit_original__: the probes must still wrap
    setattr(owner, name, new)


def _make_iter_init(orig: Callable) -> Callable:
    def rehearsal_iter_init(self: Any, loader: Any, *args: Any, **kwargs: Any) -> Any:
        self._auditor_pin = bool(getattr(loader, "pin_memory", False))
        self._auditor_loader_id = loader_key(loader)  # (the key the probes record the loader under)
        return orig(self, loader, *args, **kwargs)
    return rehearsal_iter_init


def _pin(self: Any, batch: Any) -> Any:
    """The DataLoader's pinning step that torch skipped on a CPU-only machine, as it runs on a GPU:
    in the main process with num_workers=0, in the pin-memory thread (whose error the main process
    re-raises, wrapped) otherwise."""
    if not isinstance(self, dl._MultiProcessingDataLoaderIter):
        return _pin_batch(batch)
    try:
        return _pin_batch(batch)
    except Exception:
        ExceptionWrapper(where="in pin memory thread for device 0").reraise()
        raise  # (reraise always raises)


def _make_next(orig: Callable) -> Callable:
    # The rehearsal's own work in a fetch is counted in own_time, for the data-wait probe to take
    # out: the fetch is clocked (clock.CLOCKED_THREAD), so the mode's own time in the dataset's and
    # the collate's torch calls (its lines, and torch's handing each call to it) is counted; the
    # stand-in pinning (a CPU copy; the pinned copy it stands for is not measured here) and the
    # marking of the batch are counted whole.
    def rehearsal_next(self: Any) -> Any:
        outer = clock.CLOCKED_THREAD is None
        if outer:
            clock.measure_dispatch()
            clock.CLOCKED_THREAD = threading.get_ident()
        try:
            batch = orig(self)
        finally:
            if outer:
                clock.CLOCKED_THREAD = None
        t0 = time.perf_counter()
        try:
            return _after_fetch(self, batch)
        finally:
            own_time.add(time.perf_counter() - t0)
    return rehearsal_next


def _after_fetch(self: Any, batch: Any) -> Any:
    """The batch pinned where torch would have pinned it, and its tensors marked."""
    pin = getattr(self, "_auditor_pin", False)
    if pin and not getattr(self, "_pin_memory", False):  # torch did not pin: no accelerator
        batch = _pin(self, batch)
    loader = getattr(self, "_auditor_loader_id", 0)
    on_device, nbytes = 0, 0
    for t in batch_tensors(batch):
        if getattr(t, CUDA_MARK, False):
            on_device += 1
            nbytes += t.numel() * t.element_size()
            continue
        setattr(t, LOADER_MARK, loader)
        if pin:
            setattr(t, PINNED_MARK, True)
    rec = probes.REC
    if on_device and rec is not None and rec.active:
        rec.add(m.DEVICE_BATCH, "DataLoader batch on the GPU", call_site(sys._getframe(2)), 0.0,
                loader=loader, tensors=on_device, bytes=nbytes)
    return batch


def install() -> None:
    _wrap(dl._BaseDataLoaderIter, "__init__", _make_iter_init)
    _wrap(dl._BaseDataLoaderIter, "__next__", _make_next)
    # Said once per iterator by torch; in rehearsal pinning is remembered instead, so it is noise.
    warnings.filterwarnings("ignore", message=r"'pin_memory' argument is set as true but no accelerator is found")
