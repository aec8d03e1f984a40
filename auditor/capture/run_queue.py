"""How long a thread was ready to run but waited for a CPU, kept by Linux per thread (the second
field of /proc/thread-self/schedstat, in nanoseconds: its run delay; the kernel keeps it with
CONFIG_SCHED_INFO, on in distribution kernels). Other processes' load on the cores raises it; the
thread's own work, sleeps and blocked waits (a queue, a disk) do not. The step records read it
(`steps[].waited_ms`), and a probe timing a wait of the program's takes it out: on a machine
shared with other work the clock runs on while another process holds the CPU, and that is the
machine's load, not the program's wait.

The file names the thread that opened it: each thread opens its own (a thread-local, opened anew
in a forked process: told by this_process.PID, no `gettid` call at each read), kept open (a
`pread` costs ~2 us), closed when the thread's locals go."""
from __future__ import annotations

import os
import threading

from auditor.capture import own_fds, this_process

_local = threading.local()
_PATH = "/proc/thread-self/schedstat"
_none = [False]  # the kernel keeps no run delays (no CONFIG_SCHED_INFO), or not Linux


class _File:
    def __init__(self) -> None:
        self.pid = this_process.PID
        self.fd = os.open(_PATH, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.key = own_fds.identity(self.fd)

    def __del__(self) -> None:
        try:  # (only while it is still ours: the program may have closed it and reused its number)
            own_fds.close_own(self.fd, self.key)
        except Exception:  # (at the interpreter's exit, `os` torn down)
            pass


def waited_ms() -> float | None:
    """The calling thread's run delay so far, in ms; None where the kernel does not keep it."""
    if _none[0]:
        return None
    try:
        f = getattr(_local, "file", None)
        if f is None or f.pid != this_process.PID or not own_fds.still(f.fd, f.key):
            f = _local.file = _File()
        return int(os.pread(f.fd, 128, 0).split()[1]) / 1e6
    except (OSError, AttributeError, ValueError, IndexError):
        _none[0] = True
        return None
