"""The probe that checks the ops of a user's hand-written backward as the step's own.

The backward pass runs in C++, unseen, but for the hand-written backward of a user's
`torch.autograd.Function`, which torch calls back in Python: the mode is pushed again for it, so
a division by 0 there is named at its line, not blamed on a call of the forward pass.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Callable

import torch

from auditor.capture.numerics.config_probes import _wrap
from auditor.capture.numerics.ops import _library_module
from auditor.capture.numerics.stack import _compiling, _pop_mode, _push_mode, _stack_at, _stack_len, _top_mode

if TYPE_CHECKING:
    from auditor.capture.numerics.collector_api import Collector


def install_backward_probe(col: Collector) -> None:
    """Check the ops of a hand-written backward (a `torch.autograd.Function` of the user's) as the
    step's own. torch calls it from C++ during `loss.backward()`, while the mode is off the stack
    (it is handling `backward`), so its ops would go unseen: a division by a norm that is 0 on a
    padding row there would be blamed on a norm of the forward pass whose derivative never ran. The
    mode is pushed back for that call only, if the backward pass is the step's (started through
    the mode) and the Function is the user's: torch's own (checkpoint's recompute, the module
    backward hooks' Function) and a step without such a Function cost nothing more. The ops are
    checked as they happen, not deferred: no loss comes after them to settle them."""
    owner = getattr(torch.autograd.function, "BackwardCFunction", None)
    if owner is None:  # pragma: no cover - a torch without it
        return
    users: "weakref.WeakKeyDictionary[type, str | None]" = weakref.WeakKeyDictionary()  # -> "Name.backward", the user's

    def make(orig: Callable) -> Callable:
        def probe(self, *args):
            if not col.in_backward or col.paused or not col.checking or _compiling():
                return orig(self, *args)
            cls = getattr(self, "_forward_cls", None)
            name = users.get(cls, False) if cls is not None else None
            if name is False:
                name = users[cls] = None if _library_module(cls) else f"{cls.__qualname__}.backward"
            n = _stack_len()
            if name is None or (n and _stack_at(n - 1) is col.mode):
                return orig(self, *args)
            start = len(col.ops)
            defer, col.defer_cpu = col.defer_cpu, False
            _push_mode(col.mode)
            try:
                return orig(self, *args)
            finally:
                if _stack_len() > n and _top_mode() is col.mode:
                    _pop_mode()
                col.defer_cpu = defer
                if len(col.ops) > start:
                    col.backward_fns.append((start, len(col.ops), name))
        return probe

    for method in ("apply", "apply_boxed"):
        _wrap(owner, method, make)
