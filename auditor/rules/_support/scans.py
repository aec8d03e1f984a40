"""Which graph scans of a run its growth is judged over."""
from __future__ import annotations

from auditor.evidence.model import GraphScan


def spread_scans(scans: list[GraphScan]) -> list[GraphScan]:
    """The first graph scan, the one nearest the middle of the scanned steps and the last, in step
    order. Scans run after steps 1, 4, 16, ... too (a point inside the profiled window moved out of
    it: capture.child.graph_scan_points), so that a run that dies early has two; growth is judged
    over these three, as far apart as the run allows: a leak that adds a graph every tenth step is
    not growth-free between the first two scans, and a buffer that fills by the middle and stays
    full is not growing."""
    scans = sorted(scans, key=lambda s: s.after_step)
    if len(scans) <= 3:
        return scans
    first, last = scans[0], scans[-1]
    mid = (first.after_step + last.after_step) / 2
    middle = min(scans[1:-1], key=lambda s: (abs(s.after_step - mid), s.after_step))
    return [first, middle, last]
