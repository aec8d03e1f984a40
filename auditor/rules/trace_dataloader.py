"""The trace half of dataloader-bound: DataLoader `__next__` time per ProfilerStep, as a share of the median one.

The DataloaderBound rule (owned elsewhere) calls `trace_dataloader_findings(self, evidence,
options)` and adds `TRACE_OPTIONS` to its options.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from auditor.evidence.model import Evidence
from auditor.evidence.trace.decode import CAT
from auditor.evidence.trace.intervals import intersect, merge_intervals, total_length
from auditor.evidence.trace.model import Trace
from auditor.evidence.trace.queries import DATALOADER_NEXT, frame_location_parts, sites
from auditor.rules.base import Option
from auditor.findings import Cost, Finding, Fix, Location, share_of_step, step_basis_ms

TRACE_OPTIONS: tuple[Option, ...] = (
    Option("trace-min-share", 0.25,
           "Trace: report when DataLoader __next__ takes at least this share of the median ProfilerStep "
           "(its time per step over the median step)."),
)


def step_loader_shares(trace: Trace) -> list[dict[str, Any]]:
    """Per ProfilerStep (or the whole trace when it has none): its ms and the ms inside __next__."""
    ev = trace.events
    host = ev[ev["cat"].isin((CAT["cpu_op"], CAT["annotation"])) & ~ev["instant"]]
    loader = trace.matching(DATALOADER_NEXT, host)
    iv = merge_intervals(loader["ts"].to_numpy(), loader["end"].to_numpy())
    steps = trace.steps
    windows = ([(int(s.step), float(s.ts), float(s.end)) for s in steps.itertuples()] if len(steps)
               else [(-1, *trace.window())])
    out = []
    for number, lo, hi in windows:
        inside = total_length(intersect((np.array([lo]), np.array([hi])), iv))
        out.append({"step": number, "ms": round((hi - lo) / 1000.0, 3), "loader_ms": round(inside / 1000.0, 3),
                    "share": round(inside / (hi - lo), 4) if hi > lo else 0.0})
    return out


def trace_dataloader_findings(rule: Any, evidence: Evidence, options: dict[str, Any]) -> list[Finding]:
    """One finding per trace whose steps wait on the DataLoader for a large share of their time."""
    findings = []
    threshold = float(options.get("trace-min-share", options.get("min-share", 0.25)))
    for trace in evidence.trace_data:
        ev = trace.events
        loader = trace.matching(DATALOADER_NEXT, ev[ev["cat"].isin((CAT["cpu_op"], CAT["annotation"]))])
        if not len(loader):
            continue
        per_step = step_loader_shares(trace)
        n = len(per_step)
        loader_ms = sum(s["loader_ms"] for s in per_step)
        step_ms = step_basis_ms(evidence, trace)
        share = share_of_step(round(loader_ms / n, 3), step_ms) or 0.0  # (the share every report prints for the cost)
        if share < threshold:
            continue
        shares = [s["share"] for s in per_step]
        names = sorted(set(trace.names(loader)))
        single = any("_SingleProcessDataLoaderIter" in n for n in names)
        where = sites(trace, loader.index.to_numpy(), weights=loader["dur"].to_numpy())
        message = (f"DataLoader __next__ took {loader_ms / n:.1f} ms per step in {trace.label} ({share:.0%} of the "
                   f"median {step_ms:.1f} ms step; each step's share {min(shares):.0%}-{max(shares):.0%} "
                   f"across {n} steps)" + ("; batches are loaded in the training process (num_workers=0)."
                                          if single else "; the worker processes cannot keep up."))
        fix = (Fix(summary="Load batches in worker processes: DataLoader(num_workers=4 or more, pin_memory=True, "
                           "persistent_workers=True).",
                   config={"num_workers": 4, "pin_memory": True, "persistent_workers": True})
               if single else
               Fix(summary="Give the workers more room: raise num_workers and prefetch_factor, make "
                           "__getitem__ cheaper (pre-decode, cache) or use a faster decoder.",
                   config={"num_workers": 8, "prefetch_factor": 4, "persistent_workers": True}))
        findings.append(rule.finding(
            message,
            locations=[Location(*frame_location_parts(f)) for f, _, _ in where],
            evidence={"trace": str(trace.path), "source": "trace",
                      "loader_ms_per_step": round(loader_ms / n, 3), "median_step_ms": round(step_ms, 3),
                      "iterator": names, "steps": per_step},
            cost=Cost(ms_per_step=round(loader_ms / n, 3), share_of_step=share, measured=True,
                      note="time the training thread spent inside DataLoader __next__"),
            fix=fix,
        ))
    return findings
