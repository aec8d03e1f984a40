"""This process's id, kept current across forks without a system call at each read: code that
runs at every step (the evidence writer, the resident-memory read) tells a forked DataLoader
worker from the audited process by `this_process.PID` (a step boundary's system calls are each
~20 us there, where they run cold after the step's own work)."""
from __future__ import annotations

import os

PID = os.getpid()


def _forked() -> None:
    global PID
    PID = os.getpid()


os.register_at_fork(after_in_child=_forked)
