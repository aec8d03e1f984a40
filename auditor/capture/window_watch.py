"""A watch on the profiler window's memory between the program's own read points.

A window predicted from reads at backward passes' starts and steps' ends (window_memory.Guard.fits)
sees nothing of a stretch with no such point in it: the optimizer's step and whatever follows the
last backward pass (a prediction under no_grad), which the window's end then processes unread (a
step of one backward pass, then 20,000 small calls under no_grad: the process peaked 4.9 times a
0.5 GiB bound over the window's start). The watch reads the process's resident memory on a thread of its own
every EVERY_S; where what it holds passes the limit, it has the stop run on the main thread at the
program's next bytecode (Py_AddPendingCall: no signal of the user's is touched, and never inside a
torch operator). The thread starts after the recording has: torch's Python tracer registers itself
on the threads that exist when it starts, so the watch's own calls are not in the trace.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Callable

EVERY_S = 0.002  # (a read: ~2 us; the main thread hands over the GIL within its 5 ms switch interval)
_PENDING = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_SCHEDULED: list = []  # the callbacks handed to Py_AddPendingCall: freed before they run, they would crash it


class Watch:
    """Calls `on_pass()` on the main thread once `read()` plus twice the largest growth between two
    of its reads passes `limit()` (both in bytes); `stop()` ends the watch (idempotent)."""

    def __init__(self, read: Callable[[], int | None], limit: Callable[[], int], on_pass: Callable[[], None],
                 every_s: float = EVERY_S) -> None:
        self._read, self._limit, self._on_pass, self._every = read, limit, on_pass, every_s
        self._done = threading.Event()
        self.passed_at = 0  # the resident memory the watch saw pass its limit (0: none)
        self._callback = _PENDING(self._run)  # (kept referenced until it has run)
        self._thread = threading.Thread(target=self._watch, name="auditor-window-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        last = self._read() or 0
        stride = 0
        while not self._done.wait(self._every):
            rss = self._read() or 0
            stride = max(stride, rss - last)
            last = rss
            if rss + 2 * stride > self._limit():
                self.passed_at = rss
                if not self._done.is_set():
                    _SCHEDULED.append(self._callback)
                    ctypes.pythonapi.Py_AddPendingCall(self._callback, None)
                return

    def _run(self, _arg: object) -> int:
        """The pending call, on the main thread: the stop, unless the watch was ended meanwhile."""
        if not self._done.is_set():
            self._done.set()
            try:
                self._on_pass()
            except Exception:  # (a failing stop must not raise into the user's code)
                pass
        return 0

    def stop(self) -> None:
        self._done.set()
