"""CUDA rehearsal, files: `torch.save` and `torch.load` of GPU tensors behave as on a GPU.

On a GPU, a tensor saved from the GPU comes back on the GPU (`torch.load(path)`), and
`torch.load(path, map_location="cuda")` puts every tensor there. Under rehearsal the file itself
stays what the CPU run writes (device.py keeps the marks out of pickles, so other programs and the
tests read it on this machine); what a GPU would do on reading it back is rehearsed here:

* `torch.save` notes, per file (its real path, also of a file object opened on a path; else the
  file object itself), which of the storages it
  writes belonged to tensors the program meant for the GPU, in the order torch writes them;
* `torch.load` maps every storage to the CPU and marks the tensors it returns that a GPU would put on
  the GPU: those saved from the GPU in this process, those the file says were on CUDA (a checkpoint
  written on a real GPU, which would otherwise raise "Attempting to deserialize object on a CUDA
  device"), and all of them when `map_location` asks for CUDA (a device, a string, or a dict mapping
  locations to CUDA). A `map_location` function of the program's runs as written.

The marks reach the tensors the load returns through containers, modules (their parameters and
buffers), and objects' attributes, to a bounded depth.
"""
from __future__ import annotations

import io
import os
import threading
from typing import Any, Callable

import torch
import torch.serialization as ts

from auditor.capture.rehearsal import device
from auditor.capture.rehearsal.device import is_cuda_request, mark

_MAX_DEPTH = 12
_local = threading.local()
# file key -> for each storage the save wrote, in order: whether a GPU tensor owned it
_SAVED: dict[Any, list[bool]] = {}


def _file_key(f: Any) -> Any:
    """The file a save writes or a load reads: its real path, also for a file object of a named file
    (`with open(path, "wb") as f: torch.save(model, f)`, read back through another file object of
    the same path); the object itself for one with no path (io.BytesIO)."""
    name = getattr(f, "name", None) if not isinstance(f, (str, bytes, os.PathLike)) else f
    if isinstance(name, (str, bytes, os.PathLike)):
        try:
            return os.path.realpath(os.fsdecode(name))
        except (TypeError, ValueError):
            return None
    if isinstance(f, io.IOBase) or hasattr(f, "read") or hasattr(f, "write"):
        return ("file", id(f))
    return None


def saw_marked(obj: Any) -> None:
    """Called by the pickle filter for each GPU tensor torch.save pickles: its storage is noted."""
    marked = getattr(_local, "marked", None)
    if marked is not None:
        try:
            marked.add(obj.untyped_storage()._cdata)
        except (RuntimeError, AttributeError):
            pass


def _location_tag(orig: Callable[..., Any]) -> Callable[..., Any]:
    def location_tag(storage: Any) -> Any:
        order = getattr(_local, "order", None)
        if order is not None:
            order.append(getattr(storage, "_cdata", None) in _local.marked)
        return orig(storage)

    location_tag.__wrapped__ = orig  # type: ignore[attr-defined]
    return location_tag


def _save(orig: Callable[..., Any]) -> Callable[..., Any]:
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "order", None) is not None:  # a save inside a save: the outer one notes
            return orig(obj, f, *args, **kwargs)
        _local.marked, _local.order = set(), []
        try:
            result = orig(obj, f, *args, **kwargs)
            order = _local.order
        finally:
            _local.marked = _local.order = None
        key = _file_key(f)
        if key is not None:
            if any(order):
                _SAVED[key] = order
            else:
                _SAVED.pop(key, None)
        return result

    save.__wrapped__ = orig  # type: ignore[attr-defined]
    return save


def _to_cuda(target: Any) -> bool:
    try:
        return is_cuda_request(target)
    except Exception:
        return False


def _restorer(map_location: Any, saved: list[bool] | None, found: set[int]) -> Callable[..., Any] | None:
    """The `map_location` given to the real load: every storage stays on the CPU; those a GPU would
    put on the GPU are noted in `found`. None: `map_location` is the program's function, left as is."""
    if callable(map_location) and not isinstance(map_location, torch.device):
        return None
    count = [0]

    def restore(storage: Any, location: str) -> Any:
        n = count[0]
        count[0] += 1
        if isinstance(map_location, dict):
            target = map_location.get(location, location)
        elif map_location is None:
            target = location
        else:
            target = map_location
        gpu = _to_cuda(target) or (map_location is None and saved is not None and n < len(saved) and saved[n])
        if gpu:
            found.add(storage._cdata)
            return storage
        return ts.default_restore_location(storage, str(target) if isinstance(target, torch.device) else target)

    return restore


def _mark_loaded(obj: Any, found: set[int]) -> None:
    seen: set[int] = set()
    stack = [(obj, 0)]
    while stack:
        x, depth = stack.pop()
        if id(x) in seen or depth > _MAX_DEPTH:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            try:
                if x.untyped_storage()._cdata in found:
                    mark(x)
            except (RuntimeError, NotImplementedError):
                pass
            continue
        if isinstance(x, dict):
            items = list(x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            items = list(x)
        elif isinstance(x, (str, bytes, int, float, bool, type(None))) or callable(x) and not hasattr(x, "__dict__"):
            continue
        else:
            items = list(getattr(x, "__dict__", {}).values())
        stack.extend((i, depth + 1) for i in items)


def _load(orig: Callable[..., Any]) -> Callable[..., Any]:
    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        found: set[int] = set()
        restore = _restorer(map_location, _SAVED.get(_file_key(f)), found)
        if restore is None:
            return orig(f, map_location, *args, **kwargs)
        result = orig(f, restore, *args, **kwargs)
        if found:
            _mark_loaded(result, found)
        return result

    load.__wrapped__ = orig  # type: ignore[attr-defined]
    return load


_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    device.ON_GPU_TENSOR_PICKLED = saw_marked
    ts.location_tag = _location_tag(ts.location_tag)
    save, load = _save(torch.save), _load(torch.load)
    torch.save = ts.save = save
    torch.load = ts.load = load

