"""Recording CUDA memory snapshots in the audited (child) process.

The memory rules read `torch.cuda.memory._snapshot()` pickles. These helpers switch the allocator's
history on, write a snapshot, and register an out-of-memory observer so a run that dies of OOM still
leaves the snapshot that explains it, with what the allocator told the observer beside it (see
attach_oom_observer). Each is a no-op returning False without a CUDA device, so the runner can call
them unconditionally; they return True when they did their job.

torch is imported inside the functions: importing this module must stay cheap and safe everywhere.
"""
from __future__ import annotations

import json
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any, Callable

from auditor.evidence.oom_record import MAX_OOM_FRAMES, OOM_RECORD_KIND, oom_record_path


def _cuda() -> Any | None:
    """torch, when a CUDA device is usable; None otherwise (no torch, CPU build, no device)."""
    try:
        import torch
    except ImportError:
        return None
    try:
        return torch if torch.cuda.is_available() else None
    except Exception:  # a broken driver install raises from is_available on some builds
        return None


def start_history(max_entries: int = 100_000, stacks: str = "python") -> bool:
    """Record every allocator action with its stack, keeping the last `max_entries`.

    Python stacks are enough to name the owning lines and are much cheaper to gather than
    stacks="all" (C++ unwinding on every cudaMalloc and free); backward-pass allocations then carry
    no frames at all, while "all" names their autograd node.
    """
    torch = _cuda()
    if torch is None:
        return False
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks=stacks,
                                             max_entries=max_entries)
    return True


def stop_history() -> bool:
    """Stop recording (and drop the history, as torch does when recording is switched off)."""
    torch = _cuda()
    if torch is None:
        return False
    torch.cuda.memory._record_memory_history(enabled=None)
    return True


def _atomic(path: Path, write: Callable[[Any], Any]) -> None:
    """Write atomically, never through a link (auditor.evidence.whole_files): a half-written file
    after a crash would be unreadable."""
    from auditor.evidence.whole_files import WholeFile

    path.parent.mkdir(parents=True, exist_ok=True)
    with WholeFile(path) as f:
        write(f.file)


def _write(torch: Any, path: Path) -> None:
    """The snapshot, streamed to the file (a history can be large: no second copy in memory)."""
    snapshot = torch.cuda.memory._snapshot()
    _atomic(path, lambda f: pickle.dump(snapshot, f, protocol=4))


def _caller_stack() -> list[dict[str, Any]]:
    """The Python stack of whoever called the caller, innermost first, as torch records stacks in a
    snapshot: for the observer, the Python frame that called into the allocator, and outwards. Empty
    when there is none (an allocation on a thread that runs no Python, e.g. autograd's backward)."""
    try:
        frame = sys._getframe(2)
    except ValueError:
        return []
    out: list[dict[str, Any]] = []
    while frame is not None and len(out) < MAX_OOM_FRAMES:
        out.append({"name": frame.f_code.co_name, "filename": frame.f_code.co_filename, "line": frame.f_lineno})
        frame = frame.f_back
    return out


def dump_snapshot(path: str | os.PathLike[str]) -> bool:
    """Write the allocator's current state (and history, if recording) to `path`."""
    torch = _cuda()
    if torch is None:
        return False
    _write(torch, Path(path))
    return True


def attach_oom_observer(path: str | os.PathLike[str]) -> bool:
    """Dump a snapshot to `path` whenever the allocator raises out-of-memory, and beside it (same
    name, `.json`: oom_record_path) what the allocator told the observer.

    The observer runs inside the failing allocation, before the OutOfMemoryError reaches Python, so
    the snapshot shows exactly what was live. Its history ends with the "oom" record only while a
    history is being recorded (the profiled steps); the JSON record keeps the request, what CUDA
    had free and the Python stack of the failing allocation whenever the OOM happens, so the
    post-mortem can be given for an OOM before or after the profiled window too. A later OOM
    overwrites an earlier one: the last is the one that ended the run.
    """
    torch = _cuda()
    if torch is None:
        return False
    attach: Callable[[Callable[..., None]], None] | None = getattr(
        torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is None:
        return False
    target = Path(path)
    record = oom_record_path(target)
    seen = {"ooms": 0}

    # torch's binding names the third argument `device_allocated`, but the caching allocator passes
    # the device's total memory, or the per-process limit when set_per_process_memory_fraction is in
    # force (CUDACachingAllocator.cpp: obs(device, alloc_size, set_fraction ?
    # allowed_memory_maximum : device_total, device_free)); `alloc` is the size it asked cudaMalloc
    # for, the "Tried to allocate" of the error message.
    def observer(device: int, alloc: int, device_total: int, device_free: int) -> None:
        seen["ooms"] += 1
        try:  # first, and cheap: the numbers survive even if the snapshot cannot be written
            data = json.dumps({
                "kind": OOM_RECORD_KIND, "device": device, "requested": alloc, "device_total": device_total,
                "device_free": device_free, "time_us": time.time_ns() // 1000, "ooms": seen["ooms"],
                "snapshot": target.name, "observer_args": [device, alloc, device_total, device_free],
                "frames": _caller_stack(),
            }).encode()
            _atomic(record, lambda f: f.write(data))
        except Exception:  # never turn an OOM into a different crash
            pass
        try:
            _write(torch, target)
        except Exception:
            pass

    attach(observer)
    return True
