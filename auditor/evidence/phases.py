"""Where each step's wall time went, from the probes' timed tallies.

Phases may nest in user code (a `.item()` inside forward); each tally kind is timed at the
outermost level of its own kind only, and `other` is what remains. Overlaps are rare and would
make `other` smaller, never negative (clamped at 0).
"""
from __future__ import annotations

from auditor.evidence import model as m

PHASES = ("data", "forward", "backward", "optimizer", "sync", "cleanup", "other")
_KIND_TO_PHASE = {
    m.DATA_WAIT: "data",
    m.DATA_ITER: "data",
    m.FORWARD: "forward",
    m.BACKWARD: "backward",
    m.OPTIMIZER: "optimizer",
    m.SYNC: "sync",
    m.EMPTY_CACHE: "cleanup",
    m.GC_COLLECT: "cleanup",
    m.STAT_RESET: "sync",
}


def step_phases(step: m.StepRecord) -> dict[str, float]:
    """Milliseconds per phase for one step; the values sum to the step's wall time."""
    out = dict.fromkeys(PHASES, 0.0)
    for t in step.tallies:
        phase = _KIND_TO_PHASE.get(t.kind)
        if phase:
            out[phase] += t.ms
    out["other"] = max(0.0, step.ms - sum(v for k, v in out.items() if k != "other"))
    return out


def phase_table(evidence: m.Evidence) -> list[dict[str, float]]:
    """One row per step: {"step": index, "total": ms, <phase>: ms ...}."""
    return [{"step": s.index, "total": s.ms, **step_phases(s)} for s in evidence.steps]
