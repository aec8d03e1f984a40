"""The TorchFunctionMode the collector pushes while the user's step runs.

It sees every torch call made from Python (the outermost one: `F.linear` inside `nn.Linear`, not
the kernels below it). For each call with a floating-point result the collector records `aminmax`
of the result (and of inputs no earlier call produced: parameters, data) as device tensors, plus
the op, the user's line (frames.py) and the innermost module running. Nothing is read on the host
per op: all values are stacked and read back once, at the end of the step (one device sync per
step on CUDA; see values.Values).
"""
from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Callable

import torch
from torch.overrides import TorchFunctionMode

from auditor.capture.numerics.ops import _classify, _kinds, _mutates, ALIAS, BACKWARD, SETITEM, SKIP
from auditor.capture.numerics.stack import CHECKS_RANGE, _checks_range, _compiling, _profiling, perf
from auditor.capture.unseen import no_torch_function as _no_torch_function, quietly

if TYPE_CHECKING:
    from auditor.capture.numerics.collector_api import Collector


_NO_KWARGS: dict = {}  # (never changed: `**` copies it into the callee's own dict)
_HANDLE = torch.overrides.handle_torch_function.__code__
_AT: dict[tuple, Callable] = {}  # (code, instruction) of a calling frame -> the call made from there


def _call(func, args, kwargs):
    """`func(*args, **kwargs)` from where a plain run calls it: the frame that called the torch
    function (past torch's handle_torch_function and the Python function that called it). The
    call runs in a function compiled at that file and line, with that frame's globals, so a
    warning the call raises (torch's C++ warnings, and Python ones at their stacklevel) names the
    user's line and is shown once per user line, in the user module's warning registry, as
    without the checks; called here instead, it named this file and every line's warning but the
    first was suppressed as a repeat."""
    f = sys._getframe(2)
    if f.f_code is _HANDLE:
        f = f.f_back.f_back
    key = (f.f_code, f.f_lasti)  # (the instruction: its line is computed once, on a miss)
    at = _AT.get(key)
    if at is None:
        at = _AT[key] = _caller_at(f)
    return at(func, args, kwargs)


def _caller_at(f) -> Callable:
    line = f.f_lineno
    if not line or line < 1:
        return _direct
    code = compile("\n" * (line - 1) + "def _(func, args, kwargs): return func(*args, **kwargs)",
                   f.f_code.co_filename, "exec")
    body = next(c for c in code.co_consts if isinstance(c, types.CodeType)).replace(co_name=f.f_code.co_name)
    return types.FunctionType(body, f.f_globals)


def _direct(func, args, kwargs):
    return func(*args, **kwargs)


class _Mode(TorchFunctionMode):
    """Sees each torch call made from Python while a step runs; hands it to the collector."""

    def __init__(self, col: Collector) -> None:
        super().__init__()
        self.col = col

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _compiling():  # torch.compile traces this mode too: nothing of ours may enter the user's graph
            return func(*args, **kwargs) if kwargs else func(*args)
        # Most calls are metadata or views: decided by one dict lookup, before anything else.
        try:
            kind = _kinds[func]
        except (KeyError, TypeError):
            kind = _classify(func)
        col = self.col
        if kind == SKIP or col.paused or not col.checking:
            return _call(func, args, kwargs or _NO_KWARGS)
        if kind == ALIAS:
            out = _call(func, args, kwargs or _NO_KWARGS)
            with _no_torch_function():
                col.alias(args[0], out)
            return out
        if kwargs is None:
            kwargs = {}
        if (col.pending or col.aliases) and (kind == SETITEM or _mutates.get(func) or "out" in kwargs):
            with _checks_range():
                try:
                    col.resolve_written(args, kwargs)  # a deferred output is about to be overwritten
                except Exception as e:  # our bug must never become the user's failure
                    col.failed(e)
        if kind == SETITEM:
            return _call(func, args, kwargs)
        if kind == BACKWARD:
            if not col.in_backward:  # (not a gradient a hand-written backward takes: no loss of the step)
                t0 = perf()
                with _checks_range():
                    col.on_backward(args, kwargs)
                col.check_s += perf() - t0
            col.in_backward += 1  # (a hand-written backward this pass runs is checked: see backward_probe)
            try:
                return _call(func, args, kwargs)
            finally:
                col.in_backward -= 1
        out = _call(func, args, kwargs)
        t0 = perf()
        # (_checks_range, inline: this is the path every call takes. The modes below this one, the
        # user's and torch's default-device mode, see the call above, never the checks' reads)
        with _no_torch_function():
            try:
                if _profiling():
                    with torch.autograd.profiler.record_function(CHECKS_RANGE):
                        quietly(col.on_op, func, kind, args, kwargs, out)
                else:  # (the checks untraced: a trace function of the program's sees its own calls)
                    quietly(col.on_op, func, kind, args, kwargs, out)
            except Exception as e:  # our bug must never become the user's failure
                col.failed(e)
        col.check_s += perf() - t0
        return out
