"""The user lines whose live allocations grow from step to step in a recorded allocator history:
where a leak allocates, when no graph scan found what holds it."""
from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from auditor.evidence.allocator.analysis import step_ends
from auditor.evidence.snapshot import ALLOC, FREE_COMPLETED, Snapshot, StackFrame

MiB = 1 << 20


class LineGrowth(NamedTuple):
    device: int
    frame: StackFrame  # the user line that made the allocations
    live: list[int]  # their live requested bytes at each recorded step's end


def growing_lines(snap: Snapshot, min_growth: int = MiB) -> list[LineGrowth]:
    """Lines whose live requested bytes rose at every end of an optimizer step the history
    annotates (three ends at least) and by `min_growth` in all, most growth first. Blocks made
    before the history began are not counted: they do not grow."""
    ends = step_ends(snap)
    if len(ends) < 3:
        return []
    out = []
    for device in snap.devices:
        trace = snap.device_traces[device] if device < len(snap.device_traces) else []
        live: dict[int, tuple[int, StackFrame | None]] = {}
        sums: Counter[StackFrame | None] = Counter()
        at_ends: list[dict[StackFrame | None, int]] = []
        for e in trace:
            while len(at_ends) < len(ends) and e.time_us is not None and e.time_us > ends[len(at_ends)]:
                at_ends.append(dict(sums))
            if e.addr is None:
                continue
            if e.action == ALLOC:
                live[e.addr] = (e.size, e.owner)
                sums[e.owner] += e.size
            elif e.action == FREE_COMPLETED and e.addr in live:
                size, owner = live.pop(e.addr)
                sums[owner] -= size
        if len(at_ends) < 3:
            continue
        for frame in {f for d in at_ends for f in d if f is not None}:
            series = [d.get(frame, 0) for d in at_ends]
            if all(b > a for a, b in zip(series, series[1:])) and series[-1] - series[0] >= min_growth:
                out.append(LineGrowth(device, frame, series))
    return sorted(out, key=lambda g: g.live[0] - g.live[-1])
