"""The auditor's own work in the user's process, kept out of what the user's program can observe.

An audited program must behave as it does without the audit. Where it would otherwise see the
auditor at work:

* torch-function modes. A mode on torch's mode stack sees every torch call made from Python while
  it is there, a tensor attribute read included: a `TorchFunctionMode` the user entered at import
  (an op counter, a tracer, a mode that refuses ops it does not know) and the one
  `torch.set_default_device` pushes would see, pay for, or refuse the auditor's reads of the
  user's tensors. Those run with torch-function dispatch off (`no_torch_function`).
* the warnings registry. Python shows a warning once per place by remembering where it has shown
  it, and forgets all of that whenever the warnings filters change (`catch_warnings`,
  `filterwarnings`): the user's own warnings would print again. Nothing the auditor does while the
  program runs changes the filters; `recorded_warnings` catches a call's warnings without doing so.
* torch.compile. Dynamo traces the hooks torch calls inside a compiled function (the optimizer's
  step hooks) and names what it cannot trace in warnings to the user. `not_traced` declares such a
  hook one it calls as it is.
"""
from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Any, Callable, Iterator, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

# Torch-function dispatch off, for modes and tensor subclasses alike: a C context manager, cheap
# enough for the paths every checked call takes.
no_torch_function = torch._C.DisableTorchFunction


@contextlib.contextmanager
def recorded_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """Every warning raised in the block, recorded instead of shown: `catch_warnings(record=True)`
    with `simplefilter("always")`, without telling the warnings module that its filters changed
    (which made Python forget every warning it had shown: a warning in the user's loop, shown once
    in a plain run, was shown again after each of the auditor's catches). The filters list is
    swapped in place and put back; with "always" nothing is remembered in the meantime.

    Under Python 3.14's context-aware warnings the filters live in a context variable: there
    `catch_warnings` is used as it is."""
    if getattr(sys.flags, "context_aware_warnings", False):  # pragma: no cover - Python >= 3.14
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield caught
        return
    caught: list[warnings.WarningMessage] = []

    def record(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        caught.append(warnings.WarningMessage(message, category, filename, lineno, file, line))

    filters, show = warnings.filters[:], warnings.showwarning
    warnings.filters[:] = [("always", None, Warning, None, 0)]
    warnings.showwarning = record
    try:
        yield caught
    finally:
        warnings.filters[:] = filters
        warnings.showwarning = show


def not_traced(fn: F) -> F:
    """`fn` declared to torch.compile as a function it calls as it is rather than trace: the mark
    `torch._dynamo.skip` sets, put on the function without importing dynamo (~2 s; the frames
    themselves are skipped once it is imported, see numerics._dynamo_skips_our_frames). A compiled
    function that reaches a call of `fn` breaks its graph there and runs `fn` eagerly, with no
    warning; traced, `fn` would have been inlined into the user's graph, and what dynamo cannot
    trace in it (`time.perf_counter`) named in a warning to the user."""
    fn._torchdynamo_disable = True  # type: ignore[attr-defined]
    # (what TORCH_LOGS=graph_breaks says of the break, instead of "reason: None")
    fn._torchdynamo_disable_msg = "a hook of the auditor (audit run): it runs as it is, outside the compiled graph"  # type: ignore[attr-defined]
    return fn
