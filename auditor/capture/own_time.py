"""The auditor's own time inside the program's calls, kept per thread, so that a probe timing a
call can take it out (measure the program, not the auditor).

Under rehearsal every torch call a DataLoader's dataset and collate make goes through the
rehearsal's mode, whose own Python (a few microseconds a call) is no work of the program's, and
the DataLoader's pinning, which a CPU-only torch skips, is stood in for by a CPU copy the program
would not make here. The rehearsal adds that time (`add`) while it clocks a fetch; the data-wait
probe subtracts what was added during the fetch (`spent` before and after)."""
from __future__ import annotations

import threading

_local = threading.local()


def spent() -> float:
    """Seconds of the auditor's own work counted on this thread so far."""
    return getattr(_local, "s", 0.0)


def add(seconds: float) -> None:
    _local.s = spent() + seconds
