"""The rehearsal's clock on a DataLoader fetch: which thread's fetch is clocked, and what the
mode's own work there costs beyond what it times of itself (see rehearsal.data and own_time).
The mode (rehearsal.device) times each call it handles on the clocked thread; `op` times the
call itself, which the mode's own time leaves out."""
from __future__ import annotations

import statistics
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


def _c_calls(x: torch.Tensor) -> None:
    """One round of the C-function measure: the calls a dataset's `__getitem__` and its collate make
    (a tensor from a list, a factory with keywords, an indexed write, an elementwise op, a stack).

    Why a mix: one op called in a tight loop keeps torch's hand-over to the mode hot in the caches,
    which a fetch's mix of calls and Python between them does not. On a 2.4 GHz EPYC, torch.neg alone
    read 3-4 us added a call and this mix 8.6-11.4 us, and a makemore-shaped fetch rehearsed read
    2.1x its plain wait when the former was taken out (tests/capture/test_rehearsal_data_wait.py)."""
    a = torch.tensor([1, 2, 3], dtype=torch.long, device="cpu")
    b = torch.zeros(8, dtype=torch.long, device="cpu")
    b[1:4] = a
    torch.stack([b, torch.neg(b)])


# (calls a round makes, rounds timed together): each timing is of 200 calls
_MEASURES = ((_c_calls, 5, 40), (len, 1, 200))


def measure_dispatch() -> None:
    """Set DISPATCH_S, once, on the thread about to be clocked: for each kind, the median over 9
    pairs of timings of 200 calls (plainly, then through the clocked mode) of what the mode adds to
    a call (the mix of `_c_calls`; len() of a tensor) beyond what it clocked of itself. The median of
    pairs, not the least of each side: the least picks the one timing the machine left alone, and
    under-states what the mode adds to the calls of a fetch. The measuring is itself counted as the
    auditor's own time."""
    if DISPATCH_S[0]:
        return
    global CLOCKED_THREAD
    t_start, spent0 = time.perf_counter(), own_time.spent()
    # on the host whatever the program's default device: the rehearsal must not count it as a request
    with torch._C.DisableTorchFunction():
        x = torch.zeros(2, device="cpu")

    CLOCKED_THREAD = threading.get_ident()
    try:
        for kind, (call, calls, rounds) in enumerate(_MEASURES):
            def per_call() -> float:
                t0 = time.perf_counter()
                for _ in range(rounds):
                    call(x)
                return (time.perf_counter() - t0) / (rounds * calls)

            added = []
            for _ in range(9):
                with torch._C.DisableTorchFunction():
                    plain = per_call()
                own0 = own_time.spent()
                moded = per_call()
                added.append(moded - (own_time.spent() - own0) / (rounds * calls) - plain)
            DISPATCH_S[kind] = max(statistics.median(added), 1e-9)
    finally:
        CLOCKED_THREAD = None
    own_time.add(time.perf_counter() - t_start - (own_time.spent() - spent0))


def op(func: Callable, args: tuple, kwargs: dict = _NO_KWARGS) -> Any:
    t0 = time.perf_counter()
    try:
        return func(*args, **kwargs)
    finally:
        OP_S[0] += time.perf_counter() - t0
