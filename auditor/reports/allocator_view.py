"""The allocator replay as the reports show it: findings.json's `allocator` section, and the lines
the terminal summary and the HTML page print. The replay's error against the recording always
comes before any what-if: a what-if is only as good as the replay that reproduces the recording."""
from __future__ import annotations

from typing import Any

import msgspec

from auditor.evidence.allocator.analysis import bytes_pair, reports_for, retries_and_ooms
from auditor.evidence.allocator.records import AllocatorReport
from auditor.evidence.model import Evidence
from auditor.evidence.snapshot import GiB, format_bytes


def reports(evidence: Evidence) -> list[AllocatorReport]:
    """Allocator reports of the snapshots with history (none for a run without them)."""
    if not any(s.histories for s in evidence.snapshot_data):
        return []
    return reports_for(evidence)


def document_section(evidence: Evidence) -> dict[str, Any] | None:
    """findings.json's `allocator`: the first device's report (see the README's contract)."""
    rs = reports(evidence)
    return msgspec.to_builtins(rs[0]) if rs else None


def error_line(r: AllocatorReport) -> str:
    rec, rep, err = r.recorded, r.replayed, r.error
    return (f"allocator replay of cuda:{r.device} ({r.entries:,} trace entries, capacity "
            f"{r.capacity_bytes / GiB:.2f} GiB {r.capacity_source}): recorded reserved peak "
            f"{format_bytes(rec.reserved_peak_bytes)}, {rec.segment_allocs} segment allocs, {rec.segment_frees} frees; "
            f"replayed {format_bytes(rep.reserved_peak_bytes)} ({_peak_error(err.reserved_peak_pct)}), "
            f"{rep.segment_allocs} allocs, {rep.segment_frees} frees; reserve over time off by at most "
            f"{format_bytes(err.reserved_max_diff_bytes)} (mean {format_bytes(err.reserved_mean_diff_bytes)})")


def _peak_error(pct: float | None) -> str:
    return f"{pct:+.2f}%" if pct is not None else "no recorded reserve to compare with"


def what_if_line(r: AllocatorReport, w: Any) -> str:
    rec = r.recorded
    text = (f"what if {w.alloc_conf}: reserved peak {bytes_pair(rec.reserved_peak_bytes, w.reserved_peak_bytes)}, "
            f"segment allocs {rec.segment_allocs} -> {w.segment_allocs}, "
            f"frees {rec.segment_frees} -> {w.segment_frees}, largest free block {format_bytes(w.largest_free_block_bytes)}")
    if w.ooms:
        text += f", {w.ooms} OOM(s)"
    if w.note:
        text += f" ({w.note})"
    return text


def changes(r: AllocatorReport, w: Any) -> bool:
    """True when the setting changes what the replay under the recorded settings gave: its reserved
    peak, segment allocs or frees, or its retries and OOMs (the replay's own: its churn)."""
    rep = r.replayed
    return ((w.reserved_peak_bytes, w.segment_allocs, w.segment_frees, w.retries, w.ooms)
            != (rep.reserved_peak_bytes, rep.segment_allocs, rep.segment_frees, *retries_and_ooms(r)))


def what_if_lines(r: AllocatorReport) -> list[str]:
    """A line for each what-if that changes something (changes), and one naming those that do not."""
    out = [what_if_line(r, w) for w in r.what_if if changes(r, w)]
    same = [w.alloc_conf for w in r.what_if if not changes(r, w)]
    if same:
        out.append(f"what if {', '.join(same)}: no change "
                   "(same reserved peak, segment allocs, frees, retries and OOMs)")
    return out


def steps_line(r: AllocatorReport, limit: int = 8) -> str:
    """The replayed reserve's peak per step ("" without step annotations)."""
    if not r.per_step:
        return ""
    shown = ", ".join(f"step {p.step} {format_bytes(p.reserved_peak_bytes)}" for p in r.per_step[:limit])
    more = f" (+{len(r.per_step) - limit} more)" if len(r.per_step) > limit else ""
    return f"reserved peak per step (replayed): {shown}{more}"


def lines(evidence: Evidence) -> list[str]:
    out: list[str] = []
    for r in reports(evidence):
        out.append(error_line(r))
        if r.per_step:
            out.append("  " + steps_line(r))
        out.extend("  " + line for line in what_if_lines(r))
    return out
