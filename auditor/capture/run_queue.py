"""The time a thread was ready to run but waited for a CPU, kept by Linux per thread (the second
field of /proc/thread-self/schedstat, in nanoseconds: its run-queue delay; needs the kernel's
schedstats, CONFIG_SCHED_INFO, on in distribution kernels). A probe timing a wait of the program's
takes it out: on a machine shared with other work the clock runs on while another process holds
the CPU, and that is the machine's load, not the program's wait. Time a thread spends blocked (on
a queue, a disk, a sleep) is not run-queue delay and stays in the wait.

Where the file cannot be read (not Linux, a sandboxed /proc) the delay reads 0 and waits are
the wall clock's, as before."""
from __future__ import annotations

import os
import threading

_local = threading.local()
_PATH = "/proc/thread-self/schedstat"


class _File:
    """One thread's open schedstat file, closed when the thread's locals go (the thread ended, or
    a forked process opened its own)."""

    def __init__(self) -> None:
        self.tid = threading.get_native_id()
        try:
            self.fd: int | None = os.open(_PATH, os.O_RDONLY)
        except OSError:
            self.fd = None

    def __del__(self) -> None:
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass


def delay() -> float:
    """Seconds this thread has waited on a run queue so far (0.0 where the kernel does not say).
    The file names the thread that opened it: a new thread, or a forked process, opens its own."""
    f = getattr(_local, "file", None)
    if f is None or f.tid != threading.get_native_id():
        f = _local.file = _File()
    if f.fd is None:
        return 0.0
    try:
        return int(os.pread(f.fd, 64, 0).split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0
