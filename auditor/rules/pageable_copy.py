"""pageable-copy: host<->device copies staged through pageable (unpinned) host memory."""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np

from auditor.evidence.model import Evidence
from auditor.evidence.trace import Trace, frame_location_parts, issuing_op, sites
from auditor.rules._support.text import size_text
from auditor.rules.base import Option, Rule
from auditor.findings import Cost, Finding, Fix, Location, share_of_step, step_basis_ms
from auditor.rules.probe_pageable_copy import PROBE_OPTIONS, probe_pageable_copy_findings

_DIRECTIONS = {"HtoD": "host-to-device", "DtoH": "device-to-host"}


class PageableCopy(Rule):
    """
    What it detects:
        `Memcpy HtoD (Pageable -> Device)` and `Memcpy DtoH (Device -> Pageable)` records in a profiler
        trace: tensors copied between the GPU and ordinary host memory, with how many bytes and how much
        GPU time they took per step, and the source lines that issued them.

    Why it costs:
        The GPU can only DMA from page-locked memory, so the driver first copies a pageable buffer into
        a pinned staging buffer, in pieces, with the host thread waiting. Such a copy runs at a fraction
        of the bus bandwidth, cannot overlap compute, and turns `non_blocking=True` into a blocking call.

    Example:
        loader = DataLoader(ds, batch_size=256)          # batches in pageable memory
        for x, y in loader:
            x = x.to("cuda")                             # staged, synchronous copy

    Fix:
        `DataLoader(..., pin_memory=True)` and `x.to("cuda", non_blocking=True)`; for results copied
        back, copy into a buffer made with `torch.empty(..., pin_memory=True)`.

    Evidence needed:
        A profiler trace with CUDA activity (`audit run` with profiling, or `audit analyze TRACE`).
    """

    id = "pageable-copy"
    title = "Host-device copy from pageable memory"
    severity = "warning"
    options = (
        Option("min-mb-per-step", 1.0,
               "Report a copy direction when it moves at least this many MB (1e6 bytes) per step "
               "through pageable memory; below it the staging cost is noise."),
        *PROBE_OPTIONS,
    )

    def skip_reason(self, evidence: Evidence) -> str | None:
        if evidence.trace_data or evidence.environment.rehearsal:
            return None
        return "needs a profiler trace with CUDA activity, or a CUDA rehearsal (`audit run --rehearse`)"

    def check(self, evidence: Evidence, options: dict[str, Any]) -> Iterator[Finding]:
        for trace in evidence.trace_data:
            yield from self._check_trace(trace, options, step_basis_ms(evidence, trace))
        yield from probe_pageable_copy_findings(self, evidence, options)

    def _check_trace(self, trace: Trace, options: dict[str, Any], step_ms: float | None) -> Iterator[Finding]:
        copies = trace.matching(r"Pageable", trace.of("memcpy"))
        if not len(copies):
            return
        names = trace.names(copies)
        steps = trace.step_count()
        min_bytes = float(options.get("min-mb-per-step", 1.0)) * 1e6
        link = trace.events["link"].to_numpy()
        host_dur = trace.events["dur"].to_numpy()
        for short, label in _DIRECTIONS.items():
            mask = np.array([short in n for n in names], dtype=bool)
            sel = copies[mask]
            if not len(sel):
                continue
            nbytes = int(np.clip(sel["bytes"].to_numpy(), 0, None).sum())
            if nbytes / steps < min_bytes:
                continue
            gpu_ms = float(sel["dur"].sum()) / 1000.0
            launches = link[sel.index.to_numpy()]
            host_ms = float(host_dur[launches[launches >= 0]].sum()) / 1000.0
            rows = sel.index.to_numpy()
            ops = Counter(issuing_op(trace, int(r)) or "(no operator)" for r in rows)
            where = sites(trace, rows, weights=np.clip(sel["bytes"].to_numpy(), 0, None))
            per_step_ms = round(gpu_ms / steps, 3)
            side = "to" if label.startswith("device-to-host") else "from"  # (pageable is the host end)
            message = (f"{len(sel)} {label} copies {side} pageable memory moved {size_text(nbytes)} "
                       f"({size_text(nbytes / steps)} per step) in {trace.label}, taking "
                       f"{per_step_ms:.2f} ms of GPU copy time per step; the host waited "
                       f"{host_ms / steps:.2f} ms per step in the copy calls.")
            yield self.finding(
                message,
                locations=[Location(*frame_location_parts(f)) for f, _, _ in where],
                evidence={"trace": str(trace.path), "direction": short, "copies": len(sel),
                          "copies_per_step": len(sel) / steps, "bytes": nbytes, "bytes_per_step": nbytes / steps,
                          "largest_copy_bytes": int(sel["bytes"].max()), "gpu_ms": round(gpu_ms, 3),
                          "host_ms": round(host_ms, 3), "steps": steps,
                          "median_step_ms": round(step_ms, 3) if step_ms else None,
                          "ops": dict(ops.most_common(5)),
                          "sites": [{"file": f.file, "line": f.line, "copies": n, "bytes": int(b)}
                                    for f, n, b in where]},
                cost=Cost(ms_per_step=round(per_step_ms, 3), measured=True, share_of_step=share_of_step(per_step_ms, step_ms),
                          note="GPU time of the staged copies; the host also blocks in them"),
                fix=Fix(summary="Pin the host side: DataLoader(pin_memory=True) and "
                                ".to(device, non_blocking=True); copy results back into a pinned buffer.",
                        config={"pin_memory": True, "non_blocking": True}),
            )
