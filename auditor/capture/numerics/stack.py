"""torch's mode stack without torch.overrides' Python frames, and the context the checks run in."""
from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from auditor.capture.unseen import no_torch_function as _no_torch_function

perf = time.perf_counter
CHECKS_RANGE = "auditor::numerics"  # the profiler range the checks' own ops run in
_profiling = torch._C._autograd._profiler_enabled
_NO_RANGE = contextlib.nullcontext()


class _Unseen:
    """The checks' own torch calls (aminmax, the gradient norms, item) run with torch-function
    dispatch off: a TorchFunctionMode of the user's (an op counter, a tracer) or a tensor subclass's
    `__torch_function__` must not see them (a counting mode counts the same calls a step as in a
    plain run), nor a mode passing them on take them for the user's syncs. While the profiler
    records, they also run inside an `auditor::numerics` range: the report's operator table leaves
    them out as the audit's cost. (A `with` adds no frame: the checks' fixed stack depths hold.)"""

    __slots__ = ("off", "range")

    def __enter__(self) -> None:
        self.off = _no_torch_function()
        self.off.__enter__()
        self.range = torch.autograd.profiler.record_function(CHECKS_RANGE) if _profiling() else _NO_RANGE
        self.range.__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            self.range.__exit__(*exc)
        finally:
            self.off.__exit__(*exc)


def _checks_range() -> Any:
    """The context the checks run in (see _Unseen)."""
    return _Unseen()


def _set_grad(enabled: bool) -> None:
    """Grad mode on or off for the checks (cheaper than torch.no_grad(), on every step), unseen by
    the user's torch-function modes, like the checks themselves."""
    with _no_torch_function():
        torch._C._set_grad_enabled(enabled)


_compiling = torch.compiler.is_compiling  # code traced by torch.compile is not checked (or changed)
# torch.overrides' mode-stack helpers without their Python frame (the module hooks call two per module call)
_pop_mode = torch._C._pop_torch_function_stack
_push_mode = torch._C._push_on_torch_function_stack
_stack_len = torch._C._len_torch_function_stack
_stack_at = torch._C._get_function_stack_at


def _top_mode() -> Any:
    n = _stack_len()
    return _stack_at(n - 1) if n > 0 else None
