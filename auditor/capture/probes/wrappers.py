"""How a probe wraps a torch API: the wrapper that keeps the original (put back in a DataLoader
worker), the user's call it tallies (not torch calling itself), and the compile check every probe
makes first."""
from __future__ import annotations

import functools
import sys
import time
from typing import Any, Callable

import torch

from auditor.capture.frames import is_torch_internal

perf, _grad_on = time.perf_counter, torch.is_grad_enabled  # (a sync under no_grad is tallied so: an eval loop)
# Inside code torch.compile traces, a probe is the call it wraps: traced, its frame reads and timers
# would be graph breaks in the user's graph, each with a warning naming what dynamo cannot trace
# (sys._getframe, time.perf_counter), and a timer's value a guard that recompiles it. Where dynamo
# gives up on a call, it runs it as it is, and the probe records it there.
_compiling = torch.compiler.is_compiling


# A call made from these is a torch-function mode's or a tensor subclass's handler passing on a
# call it intercepted (`return func(*args, **kwargs)`): the probe already saw that call where it was
# made (the user's line, or the auditor's own check), and must not count it again at the handler.
_DISPATCHERS = frozenset(("__torch_function__", "__torch_dispatch__"))


def _user_call(depth: int = 2):
    """The calling frame if the call is the user's (not torch calling itself), else None."""
    f = sys._getframe(depth)
    code = f.f_code
    return None if is_torch_internal(code.co_filename) or code.co_name in _DISPATCHERS else f


def _wrap(owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    orig = getattr(owner, name)
    if getattr(orig, "__audit_original__", None) is not None:
        return  # already wrapped
    new = make(orig)
    functools.update_wrapper(new, orig)
    new.__audit_original__ = orig
    _WRAPPED.append((owner, name, vars(owner).get(name, orig) if isinstance(owner, type) else orig))
    setattr(owner, name, new)
    if _part_on[1]:
        _PART.append((owner, name, orig, new))


# every wrapper the probes put on torch: (owner, name, what was there), put back in a DataLoader
# worker (workers.forked)
_WRAPPED: list[tuple[Any, str, Any]] = []


# the wrappers of the bench's "probes" part (auditor.capture.bench_switches), kept as they are made
# for set_part_probes: (owner, name, original, wrapper)
_PART: list[tuple[Any, str, Any, Any]] = []
_part_on = [True, False]  # [the part's wrappers in place, the wrappers made now are the part's]


def set_part_probes(on: bool) -> None:
    """The "probes" part's wrappers put back (on) or taken out (bench_steady_parts.py --toggle only:
    each swap costs CPython's attribute caches, so only at the blocks' edges)."""
    if on != _part_on[0] and _PART:
        _part_on[0] = on
        for owner, name, orig, new in _PART:
            setattr(owner, name, new if on else orig)
