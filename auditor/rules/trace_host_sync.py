"""The trace half of host-sync: synchronisations a profiler trace recorded, per issuing operator.

The HostSync rule (owned elsewhere) calls `trace_host_sync_findings(self, evidence, options)` and
adds `TRACE_OPTIONS` to its options. Starting from the sync calls themselves (not from `item()`
calls), and from the copies to pageable memory that wait as a sync does, is what keeps an `aten::item` on a CPU tensor, which never waits for a GPU, out of it.
What is counted is the operator calls that waited, not the runtime rows they waited in: `.cpu()` of
a GPU tensor copies to pageable memory (a wait) and then syncs its stream (another) in one call.

When the trace has ProfilerSteps, only syncs inside a step count. torch.profiler synchronizes the
device itself when it stops, right after the last step: that `cudaDeviceSynchronize` is in every
recorded fixture (158 ms on the A100 rank-0 one, waiting for the queued work of the last step) and
is the profiler's, not the user's. Syncs before the first step are set-up, not a per-step cost.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import numpy as np

from auditor.evidence.model import Evidence
from auditor.evidence.trace import (
    ASYNC_COPY_CALLS,
    Trace,
    blocking_calls,
    blocking_op_calls,
    frame_location_parts,
    gpu_idle_behind,
    merge_intervals,
    sites,
    total_length,
)
from auditor.rules.base import Option
from auditor.findings import Cost, Finding, Fix, Location, share_of_step, step_basis_ms
from auditor.rules._support.text import per_step as rate_text

TRACE_OPTIONS: tuple[Option, ...] = (
    Option("trace-min-syncs", 1,
           "Trace: report an operator once it synchronised at least this many times in the trace."),
    Option("trace-warning-share", 0.05,
           "Trace: a finding is a warning when its syncs block this share of the step or more, else info."),
)

_ADVICE = {
    "aten::item": "Keep the value on the GPU (accumulate tensors) and call .item() once every N steps.",
    "aten::_local_scalar_dense": "Keep the value on the GPU (accumulate tensors) and call .item() once every N steps.",
    "aten::is_nonzero": "A Python `if`/`bool()` on a GPU tensor waits for it: use torch.where or keep "
                        "control flow on the host.",
    "aten::to": "Copy with .to(device, non_blocking=True) from pinned memory, and avoid .cpu()/.numpy() "
                "inside the step.",
    "aten::copy_": "Copy with non_blocking=True from pinned memory, and avoid .cpu()/.numpy() inside the step.",
    "aten::nonzero": "nonzero/masked_select/boolean indexing have data-dependent shapes and must sync: "
                     "use torch.where or a fixed-size mask.",
    "aten::masked_select": "Data-dependent output shape forces a sync: use torch.where with a fixed-size mask.",
    "aten::unique": "Data-dependent output shape forces a sync: avoid unique inside the step.",
}


def _advice(op: str) -> str:
    if op in _ADVICE:
        return _ADVICE[op]
    if op in ("cudaDeviceSynchronize", "cudaStreamSynchronize"):
        return "Remove torch.cuda.synchronize() from the training step (keep it only around timing code)."
    if op == "cudaEventSynchronize":
        return "An event wait blocks the host: use stream.wait_event() to order GPU work instead."
    return "Avoid reading GPU results on the host inside the step."


def _api(trace: Trace, row: int) -> str:
    name = trace.name(row)
    return f"{name} to pageable memory" if name in ASYNC_COPY_CALLS else name


def trace_host_sync_findings(rule: Any, evidence: Evidence, options: dict[str, Any]) -> list[Finding]:
    """One finding per (trace, issuing operator) for every recorded host<->GPU synchronisation."""
    out: list[Finding] = []
    for trace in evidence.trace_data:
        out.extend(_trace_findings(rule, trace, options, step_basis_ms(evidence, trace)))
    return out


def _trace_findings(rule: Any, trace: Trace, options: dict[str, Any], step_ms: float | None) -> list[Finding]:
    rows = blocking_calls(trace)
    if len(trace.steps):
        rows = rows[trace.col("step")[rows] >= 0]
    if not len(rows):
        return []
    steps = trace.step_count()
    # One operator call can block in several rows (a copy to pageable memory, then the stream sync
    # after it, in one `.to()`): what is counted is the call, and what it blocked is its rows' union.
    calls: dict[int, list[int]] = defaultdict(list)
    for r, call in zip(rows, blocking_op_calls(trace, rows)):
        calls[int(call)].append(int(r))
    groups: dict[str, list[list[int]]] = defaultdict(list)
    for call, members in calls.items():
        groups[trace.name(call)].append(members)  # the issuing op; a bare sync call is named by its API
    ts, end = trace.col("ts"), trace.col("end")
    min_syncs = int(options.get("trace-min-syncs", 1))
    warn_share = float(options.get("trace-warning-share", 0.05))
    findings = []
    for op, members in groups.items():
        if len(members) < min_syncs:
            continue
        rows_of_op = [r for m in members for r in m]
        waited = np.array([total_length(merge_intervals(ts[m], end[m])) for m in members])  # us per call
        blocked_ms = float(waited.sum()) / 1000.0
        per_step = round(blocked_ms / steps, 3)
        share = share_of_step(per_step, step_ms)  # (the host's blocked time: not the cost, said apart)
        idle_ms = round(gpu_idle_behind(trace, np.asarray(rows_of_op)) / 1000.0 / steps, 3)
        apis = Counter(_api(trace, r) for r in rows_of_op)  # (runtime rows by API: a call may hold two)
        chains = Counter(" > ".join(reversed(trace.op_chain(m[0])[:4])) for m in members)
        where = sites(trace, [m[0] for m in members], weights=waited)
        n = len(members)
        times = "once" if n == 1 else f"{n} times"
        message = (f"{op} blocked the host on the GPU {times} in {trace.label} "
                   f"({rate_text(n / steps)} per step), {per_step:.2f} ms per step"
                   + (f" ({share:.1%} of the median step)" if share is not None else "")
                   + f" spent waiting in {', '.join(apis)}; the GPU sat idle {idle_ms:.2f} ms per step "
                   "while the host waited there and before it queued new work (what removing them can give back).")
        findings.append(rule.finding(
            message,
            severity="warning" if share is not None and share >= warn_share else "info",  # (the host's time)
            locations=[Location(*frame_location_parts(f)) for f, _, _ in where],
            evidence={"trace": str(trace.path), "source": "trace", "op": op, "syncs": n,
                      "syncs_per_step": round(n / steps, 2), "blocked_ms": round(blocked_ms, 3),
                      "blocked_ms_per_step": round(per_step, 3), "steps": steps,
                      "median_step_ms": round(step_ms, 3) if step_ms else None,
                      "apis": dict(apis), "op_chains": dict(chains.most_common(3)),
                      "longest_ms": round(float(waited.max()) / 1000.0, 3),
                      "gpu_idle_ms_per_step": round(idle_ms, 3),
                      "sites": [{"file": f.file, "line": f.line, "syncs": k, "ms": round(w / 1000.0, 3)}
                                for f, k, w in where]},
            # This idle time lies inside gpu-idle's idle total of the same trace: the headline's
            # recoverable sum counts it once (reports.terminal.recoverable).
            cost=Cost(ms_per_step=round(idle_ms, 3), share_of_step=share_of_step(idle_ms, step_ms), measured=True,
                      note="GPU idle time while the host waited in these calls and until the GPU's next "
                           "work (the host's own blocked time is in the evidence)",
                      within="gpu-idle"),
            fix=Fix(summary=_advice(op),
                    config={"non_blocking": True} if op in ("aten::to", "aten::copy_") else {}),
        ))
    return findings
