"""The rehearsal's clock on a DataLoader fetch: which thread's fetch is clocked, and what the
mode's own work there costs beyond what it times of itself (see rehearsal.data and own_time).
The mode (rehearsal.device) times each call it handles on the clocked thread; `op` times the
call itself, which the mode's own time leaves out."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch

from auditor.capture import own_time

_NO_KWARGS: dict = {}

# The thread whose DataLoader fetch the rehearsal is clocking (rehearsal.data), None when none is,
# and the seconds the calls themselves took there (_op), which the mode's own time leaves out.
CLOCKED_THREAD: int | None = None
OP_S = [0.0]


# What the mode adds to a call beyond what it clocks of itself (torch handing the call to the mode
# and back, the clock's own reads): for a call of torch's C functions ([0]), and of a Tensor method
# written in Python ([1], e.g. __len__, which goes through torch.overrides.handle_torch_function).
DISPATCH_S = [0.0, 0.0]


def measure_dispatch() -> None:
    """Set DISPATCH_S, once, on the thread about to be clocked: the least, over 5 rounds of 200
    calls, of what the clocked mode adds to a small torch call (torch.neg; len() of a tensor) less
    what it clocked of itself. The measuring is itself counted as the auditor's own time."""
    if DISPATCH_S[0]:
        return
    global CLOCKED_THREAD
    t_start, spent0 = time.perf_counter(), own_time.spent()
    # on the host whatever the program's default device: the rehearsal must not count it as a request
    with torch._C.DisableTorchFunction():
        x = torch.zeros(2, device="cpu")

    def per_call(call: Callable) -> float:
        t0 = time.perf_counter()
        for _ in range(200):
            call(x)
        return (time.perf_counter() - t0) / 200

    CLOCKED_THREAD = threading.get_ident()
    try:
        for kind, call in enumerate((torch.neg, len)):
            plain, added = [], []
            for _ in range(5):
                with torch._C.DisableTorchFunction():
                    plain.append(per_call(call))
                own0 = own_time.spent()
                moded = per_call(call)
                added.append(moded - (own_time.spent() - own0) / 200)
            DISPATCH_S[kind] = max(min(added) - min(plain), 1e-9)
    finally:
        CLOCKED_THREAD = None
    own_time.add(time.perf_counter() - t_start - (own_time.spent() - spent0))


def op(func: Callable, args: tuple, kwargs: dict = _NO_KWARGS) -> Any:
    t0 = time.perf_counter()
    try:
        return func(*args, **kwargs)
    finally:
        OP_S[0] += time.perf_counter() - t0
