"""Recording CUDA memory snapshots in the audited (child) process.

The memory rules read `torch.cuda.memory._snapshot()` pickles. These helpers switch the allocator's
history on, write a snapshot, and register an out-of-memory observer so a run that dies of OOM still
leaves the snapshot that explains it. Each is a no-op returning False without a CUDA device, so the
runner can call them unconditionally; they return True when they did their job.

torch is imported inside the functions: importing this module must stay cheap and safe everywhere.
"""
from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any, Callable


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


def _write(torch: Any, path: Path) -> None:
    """Write the snapshot atomically: a half-written pickle after a crash would be unreadable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        pickle.dump(torch.cuda.memory._snapshot(), f, protocol=4)
    os.replace(tmp, path)


def dump_snapshot(path: str | os.PathLike[str]) -> bool:
    """Write the allocator's current state (and history, if recording) to `path`."""
    torch = _cuda()
    if torch is None:
        return False
    _write(torch, Path(path))
    return True


def attach_oom_observer(path: str | os.PathLike[str]) -> bool:
    """Dump a snapshot to `path` whenever the allocator raises out-of-memory.

    The observer runs inside the failing allocation, before the OutOfMemoryError reaches Python, so
    the snapshot shows exactly what was live and the history ends with the "oom" record. A later
    OOM overwrites an earlier one: the last is the one that ended the run.
    """
    torch = _cuda()
    if torch is None:
        return False
    attach: Callable[[Callable[..., None]], None] | None = getattr(
        torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is None:
        return False
    target = Path(path)

    def observer(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
        try:
            _write(torch, target)
        except Exception:  # never turn an OOM into a different crash
            pass

    attach(observer)
    return True
