"""`auditor.step()`, the marker of a training loop's iteration, and who listens to it: `audit run
file.py` (auditor.capture.steps) while it audits a whole program; nobody otherwise."""
from __future__ import annotations

from typing import Callable

_listener: Callable[[], None] | None = None


def step() -> None:
    """Mark the end of one iteration of your training loop, for `audit run file.py` to count steps
    by where neither an optimizer step nor a DataLoader iteration marks them. A no-op (one global
    read) when the program is not being audited."""
    listener = _listener
    if listener is not None:
        listener()


def listen(listener: Callable[[], None]) -> Callable[[], None]:
    """Have `listener()` called at each `auditor.step()` from now on; returns the undo."""
    global _listener
    _listener = listener

    def undo() -> None:
        global _listener
        _listener = None

    return undo
