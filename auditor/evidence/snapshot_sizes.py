"""Sizes a memory snapshot cannot hold: the segments and trace entries holding one are left out
where the snapshot is read (auditor.evidence.snapshot), and counted."""
from __future__ import annotations

from typing import Any

# The most bytes a size in a snapshot can be: a PiB, past any device's memory. A size beyond it (2**70),
# a negative one or one that is no integer (a string, NaN) is no allocator's record: the segment or
# trace entry holding it is left out and counted (Snapshot.dropped), not replayed into "-5 B
# reserved" or an OverflowError.
MAX_BYTES = 2 ** 50
_SIZE_KEYS = ("size", "total_size", "allocated_size", "active_size", "requested_size")


def impossible(raw: Any) -> str | None:
    """The first size key of a segment, block or trace entry (a dict) whose value cannot be, with it."""
    if not isinstance(raw, dict):
        return None
    for key in _SIZE_KEYS:
        v = raw.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_BYTES:
            shown = repr(v) if not isinstance(v, int) or abs(v) < 10 ** 20 else f"{v:.3g}"
            return f"{key} {shown[:40]}"
    blocks = raw.get("blocks")
    for b in blocks if isinstance(blocks, list) else ():
        why = impossible(b)
        if why is not None:
            return f"a block's {why}"
    return None


def sane(items: list, what: str, dropped: list) -> list:
    """`items` without those holding an impossible size; each left out counted in `dropped`
    ([count, first reason]) as `what`."""
    out = []
    for item in items:
        # (a trace entry's one size, checked inline: a snapshot holds tens of thousands of them)
        v = item.get("size") if type(item) is dict and "blocks" not in item else None
        if type(v) is int and 0 <= v <= MAX_BYTES and "total_size" not in item:
            out.append(item)
            continue
        why = impossible(item)
        if why is None:
            out.append(item)
            continue
        if not dropped[0]:
            dropped[1] = f"{what}: {why}"
        dropped[0] += 1
    return out
