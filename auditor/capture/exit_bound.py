"""The audited program's end, bounded: after its run, Python joins the program's non-daemon threads
and runs its atexit handlers, and the audit waits for them at most a grace period."""
from __future__ import annotations

import os
import sys
import threading
import time

EXIT_GRACE_S = 60.0  # how long the program's end (its threads, its atexit handlers) may take
# A program whose end takes longer on purpose (an atexit upload of its checkpoints) sets it higher.
EXIT_GRACE_VAR = "AUDIT_EXIT_GRACE_S"


def exit_grace_s() -> float:
    """The seconds the program's end may take: AUDIT_EXIT_GRACE_S when it is a positive number."""
    try:
        value = float(os.environ.get(EXIT_GRACE_VAR, ""))
    except ValueError:
        return EXIT_GRACE_S
    return value if value > 0 else EXIT_GRACE_S


def bound_exit(code: int, grace_s: float | None = None) -> None:
    """After the run, Python joins the program's non-daemon threads and runs its atexit handlers;
    one that never ends (a thread left running, a worker never joined) would keep `audit` waiting
    forever. A daemon thread ends the process `grace_s` seconds later (exit_grace_s()), saying so
    on stderr."""
    grace_s = exit_grace_s() if grace_s is None else grace_s

    def stop() -> None:
        time.sleep(grace_s)
        try:
            sys.stderr.write(f"audit: the program had not ended {grace_s:g} s after its run (a non-daemon "
                             "thread or an atexit handler still running): its process is ended\n")
            sys.stderr.flush()
        finally:
            os._exit(code)

    threading.Thread(target=stop, name="audit-exit-bound", daemon=True).start()
