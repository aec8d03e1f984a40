"""Timed calls the rules judge by their cost: CUDA cache and peak-statistics resets, gc.collect,
torch.save (its file, for a checkpoint saved once the weights are NaN)."""
from __future__ import annotations

import gc
import os
from typing import Any, Callable

import torch

from auditor.capture.frames import user_frame
from auditor.capture.frames import via_data as _via
from auditor.capture.probes.recorder import REC
from auditor.capture.probes.wrappers import _compiling, _user_call, _wrap, perf
from auditor.evidence import model as m


def _timed_function(kind: str, what: str, data: Callable[..., dict] | None = None):
    """A probe that times the user's calls of a function and tallies them at their line; `data`,
    given the call's arguments, adds what the tally keeps of them (torch.save: the file)."""
    def make(orig):
        def probe(*args, **kwargs):
            if _compiling():
                return orig(*args, **kwargs)
            rec = REC
            if rec.active:
                f = _user_call()
                if f is not None:
                    t0 = perf()
                    try:
                        return orig(*args, **kwargs)
                    finally:
                        rec.add(kind, what, user_frame(f), (perf() - t0) * 1e3,
                                **(data(*args, **kwargs) if data else {}), **_via(f))
            return orig(*args, **kwargs)
        return probe
    return make


def _install_timed_probes() -> None:
    for name in ("reset_peak_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached",
                 "reset_accumulated_memory_stats"):
        if hasattr(torch.cuda, name):
            _wrap(torch.cuda, name, _timed_function(m.STAT_RESET, f"torch.cuda.{name}"))
    _wrap(torch.cuda, "empty_cache", _timed_function(m.EMPTY_CACHE, "torch.cuda.empty_cache"))
    # torch.accelerator's device-generic twins (PyTorch's own examples call these now)
    acc = getattr(torch, "accelerator", None)
    for name in ("reset_peak_memory_stats", "reset_accumulated_memory_stats"):
        if acc is not None and hasattr(acc, name):
            _wrap(acc, name, _timed_function(m.STAT_RESET, f"torch.accelerator.{name}"))
    if acc is not None and hasattr(acc, "empty_cache"):
        _wrap(acc, "empty_cache", _timed_function(m.EMPTY_CACHE, "torch.accelerator.empty_cache"))
    _wrap(gc, "collect", _timed_function(m.GC_COLLECT, "gc.collect"))
    _wrap(torch, "save", _timed_function(m.SAVE, "torch.save", _saved_file))


def _saved_file(obj: Any = None, f: Any = None, *args: Any, **kwargs: Any) -> dict:
    """torch.save's file: a checkpoint saved once the weights are NaN is poisoned, and nonfinite
    names it and the last one saved before (None for a buffer or an open file object)."""
    path = os.fspath(f) if isinstance(f, (str, os.PathLike)) else None
    return {"path": os.path.abspath(path) if isinstance(path, str) else None}
