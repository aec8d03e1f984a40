"""On a machine without CUDA, answer the torch.cuda memory-statistics family as an idle device would.

GPU trainers are full of debug calls such as `torch.cuda.reset_peak_memory_stats()`; on a CPU-only
torch build some of them raise (`module 'torch._C' has no attribute '_cuda_resetPeakMemoryStats'`),
which would stop the audit before it sees anything. Each stand-in records that it was called (so
the rules still judge those calls) and returns what an idle device reports: zeros, empty stats.
"""
from __future__ import annotations

import functools
import pickle
import sys
from collections import OrderedDict
from typing import Any, Callable

import torch

from auditor.capture.frames import user_frame
from auditor.evidence import model as m

_ZERO = ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
         "memory_cached", "max_memory_cached")
_NONE = ("reset_peak_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached",
         "reset_accumulated_memory_stats", "empty_cache", "synchronize", "ipc_collect")


def _idle_summary(*args: Any, **kwargs: Any) -> str:
    return "|  (no CUDA device: memory summary of an idle device)  |\n"


def _answers() -> dict[str, Callable[..., Any]]:
    out: dict[str, Callable[..., Any]] = {}
    for name in _ZERO:
        out[name] = lambda *a, **k: 0
    for name in _NONE:
        out[name] = lambda *a, **k: None
    out["memory_stats"] = lambda *a, **k: OrderedDict()
    out["memory_stats_as_nested_dict"] = lambda *a, **k: {}
    out["memory_summary"] = _idle_summary
    out["memory_snapshot"] = lambda *a, **k: []
    return out


def _idle_snapshot(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return {"segments": [], "device_traces": [[]]}


def _dump_idle_snapshot(filename: str = "dump_snapshot.pickle", *args: Any, **kwargs: Any) -> None:
    with open(filename, "wb") as f:
        pickle.dump(_idle_snapshot(), f)


# torch.cuda.memory's allocator history, as the docs' "understanding CUDA memory usage" has programs
# call it (its C++ half is absent from a CPU build: AttributeError at the first call). A dump
# writes the snapshot of an idle device, so the program's own reading of it still runs.
HISTORY = {
    "_record_memory_history": lambda *a, **k: None,
    "_snapshot": _idle_snapshot,
    "_dump_snapshot": _dump_idle_snapshot,
}


def install(recorder_getter: Callable[[], Any]) -> list[str]:
    """Replace the family on torch.cuda when CUDA is absent. Returns the names replaced."""
    if torch.cuda.is_available():
        return []
    replaced = []
    for owner, prefix, answers in ((torch.cuda, "torch.cuda", _answers()),
                                   (torch.cuda.memory, "torch.cuda.memory", HISTORY)):
        for name, answer in answers.items():
            if not hasattr(owner, name):
                continue

            def standin(*args: Any, __name: str = f"{prefix}.{name}", __answer: Callable[..., Any] = answer,
                        **kwargs: Any) -> Any:
                rec = recorder_getter()
                if rec is not None and rec.active:
                    rec.add(m.CUDA_STANDIN, __name, user_frame(sys._getframe(1)))
                return __answer(*args, **kwargs)

            functools.update_wrapper(standin, getattr(owner, name))
            setattr(owner, name, standin)
            replaced.append(name if owner is torch.cuda else f"memory.{name}")
    return replaced
