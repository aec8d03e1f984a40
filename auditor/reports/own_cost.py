"""The summary's line of what the audit itself cost, from its measured steps (evidence.own_cost)."""
from __future__ import annotations

from auditor.evidence.model import Evidence
from auditor.evidence.own_cost import own_cost


def _vs(ms: float, base: float) -> str:
    return f"{ms / base - 1:+.0%}" if ms < 2 * base else f"{ms / base:.1f}x"


def own_cost_phrase(evidence: Evidence) -> str | None:
    """'the audit's own cost, measured: ...', or None for a run with nothing to compare (a
    recording, one step)."""
    c = own_cost(evidence)
    if not evidence.steps or (not c.checked_steps and not c.profiled_steps):
        return None
    parts = []
    if c.checked_steps and c.timed_ms:
        parts.append(f"{len(c.checked_steps)} step(s) with numerics checks {c.checked_ms:.2f} ms median "
                     f"({_vs(c.checked_ms, c.timed_ms)} over the {len(c.timed_steps)} timed step(s)' "
                     f"{c.timed_ms:.2f} ms, which carry nothing of the audit's)")
    elif c.checked_steps:
        parts.append(f"every unprofiled step carried numerics checks ({c.checked_ms:.2f} ms median; "
                     "no step without them to compare)")
    if c.profiled_steps and c.unprofiled_ms:
        parts.append(f"{len(c.profiled_steps)} profiled step(s) {c.profiled_ms:.2f} ms median "
                     f"({_vs(c.profiled_ms, c.unprofiled_ms)} over the unprofiled steps' {c.unprofiled_ms:.2f} ms; "
                     "not in the median)")
    return "the audit's own cost, measured: " + "; ".join(parts) if parts else None
