"""dataloader-on-device: the input pipeline launches GPU work while producing a batch."""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np

from auditor.evidence.model import Evidence
from auditor.evidence.trace.decode import CAT, GPU_WORK, LAUNCH_SIDE
from auditor.evidence.trace.intervals import merge_intervals
from auditor.evidence.trace.model import Trace
from auditor.evidence.trace.queries import DATALOADER_NEXT, frame_location_parts, issuing_op, sites
from auditor.rules.base import Option, TraceRule
from auditor.findings import Cost, Finding, Fix, Location
from auditor.rules.probe_dataloader_on_device import PROBE_OPTIONS, probe_dataloader_on_device_findings

_COLLATE = r"(^|[/(])\S*collate\S*\.py\(|\): \S*collate\S*$"
# Device allocations (cudaMalloc, cudaMallocAsync, cudaMallocManaged, cuMemAlloc_v2 ...), never the
# page-locked *host* allocations pin_memory=True makes (cudaHostAlloc, cudaMallocHost, cuMemHostAlloc,
# cuMemAllocHost, cudaHostRegister): those are what the fix asks for, not GPU tensors.
_ALLOC = r"^(cudaMalloc(?!Host)|cuMemAlloc(?!Host))"


class DataloaderOnDevice(TraceRule):
    """
    What it detects:
        CUDA launches, copies and allocations issued while the main process is inside DataLoader
        iteration (`enumerate(DataLoader)#..._next__`) or a collate function, from a profiler trace:
        how many per step, the GPU time they caused, the operators and the source lines. What counts:
        runtime/driver calls that put a kernel, copy or memset on the GPU, and device allocations
        (`cudaMalloc*`, `cuMemAlloc*`). What does not: pinning host memory, which `pin_memory=True`
        does inside `__next__` when num_workers=0 (`cudaHostAlloc`, `cudaMallocHost`, `cuMemHostAlloc`,
        `cudaHostRegister`, and the pinned allocator's `cudaEventQuery` polls of earlier copies), and
        other calls whose only GPU-side record is a sync.

    Why it costs:
        GPU work issued from the loader runs on the training stream between steps, so it cannot overlap
        the model; it forbids `num_workers > 0` (CUDA cannot be re-initialised in forked workers), so
        the whole pipeline stays on the training thread; and it usually means small, unbatched copies.

    Example:
        class DS(Dataset):
            def __getitem__(self, i):
                return torch.tensor(self.rows[i], device="cuda")   # a copy per sample

    Fix:
        Produce CPU tensors in the Dataset and collate_fn; move the batch once in the training loop
        with `pin_memory=True` and `.to(device, non_blocking=True)`, then raise `num_workers`.

    Evidence needed:
        A profiler trace with CUDA activity that covers DataLoader iteration (record_function names
        are on by default).
    """

    id = "dataloader-on-device"
    title = "Input pipeline uses the GPU"
    severity = "warning"
    options = (
        Option("min-launches-per-step", 1, "Report when the loader issues at least this many GPU calls per step."),
        *PROBE_OPTIONS,
    )

    def skip_reason(self, evidence: Evidence) -> str | None:
        return None if evidence.environment.rehearsal else super().skip_reason(evidence)

    def check(self, evidence: Evidence, options: dict[str, Any]) -> Iterable[Finding]:
        yield from super().check(evidence, options)
        yield from probe_dataloader_on_device_findings(self, evidence, options)

    def check_trace(self, trace: Trace, options: dict[str, Any]) -> Finding | None:
        ev = trace.events
        cat, names, ts, end = trace.col("cat"), trace.col("name"), trace.col("ts"), trace.col("end")
        pid, tid = trace.col("pid"), trace.col("tid")
        host = np.isin(cat, (CAT["cpu_op"], CAT["annotation"], CAT["python"])) & ~trace.col("instant")
        pipeline = host & np.isin(names, trace.symbols.matching(DATALOADER_NEXT))
        pipeline |= (cat == CAT["python"]) & np.isin(names, trace.symbols.matching(_COLLATE))
        ranges = np.flatnonzero(pipeline)
        if not len(ranges):
            return None
        # A call counts when the GPU row it maps to is work (kernel, copy, memset), not a sync record:
        # recent profilers pair event polls and waits (the pinned allocator's cudaEventQuery) with
        # a `cuda_sync` row too.
        link = trace.col("link")
        launches_work = np.zeros(len(link), dtype=bool)
        linked = np.flatnonzero(link >= 0)
        launches_work[linked] = np.isin(cat[link[linked]], GPU_WORK)
        launches_work |= np.isin(names, trace.symbols.matching(_ALLOC))
        call_mask = np.isin(cat, LAUNCH_SIDE) & launches_work
        calls = np.flatnonzero(call_mask)
        inside = np.zeros(len(calls), dtype=bool)
        for key in set(zip(pid[ranges].tolist(), tid[ranges].tolist())):
            group = ranges[(pid[ranges] == key[0]) & (tid[ranges] == key[1])]
            s, e = merge_intervals(ts[group], end[group])
            on_thread = (pid[calls] == key[0]) & (tid[calls] == key[1])
            t = ts[calls]
            k = np.searchsorted(s, t, side="right") - 1
            inside |= on_thread & (k >= 0) & (t < e[np.maximum(k, 0)])
        found = ev.iloc[calls[inside]]
        steps = trace.step_count()
        if len(found) / steps < float(options.get("min-launches-per-step", 1)) or not len(found):
            return None
        link = found["link"].to_numpy()
        gpu_rows = link[link >= 0]
        cats = ev["cat"].to_numpy()[gpu_rows]
        gpu_ms = float(ev["dur"].to_numpy()[gpu_rows].sum()) / 1000.0
        copy_bytes = int(np.clip(ev["bytes"].to_numpy()[gpu_rows][cats == CAT["memcpy"]], 0, None).sum())
        host_ms = float(found["dur"].sum()) / 1000.0
        rows = found.index.to_numpy()
        ops = Counter(issuing_op(trace, int(r)) or trace.name(int(r)) for r in rows)
        where = sites(trace, rows)
        message = (f"The input pipeline issued {len(found)} GPU calls ({len(found) / steps:.1f} per step: "
                   f"{int((cats == CAT['kernel']).sum())} kernels, {int((cats == CAT['memcpy']).sum())} copies) "
                   f"inside DataLoader iteration in {trace.label}, mostly from "
                   f"{', '.join(n for n, _ in ops.most_common(3))}.")
        return self.finding(
            message,
            locations=[Location(*frame_location_parts(f)) for f, _, _ in where],
            evidence={"trace": str(trace.path), "steps": steps, "calls": len(found),
                      "kernels": int((cats == CAT["kernel"]).sum()), "copies": int((cats == CAT["memcpy"]).sum()),
                      "copy_bytes": copy_bytes, "gpu_ms": round(gpu_ms, 3), "host_ms": round(host_ms, 3),
                      "ops": dict(ops.most_common(8)),
                      "sites": [{"file": f.file, "line": f.line, "calls": n} for f, n, _ in where]},
            cost=Cost(ms_per_step=round(host_ms / steps, 3), share_of_step=None,  # (TraceRule.check sets it)
                      measured=True, note="host time of the GPU calls made inside the loader"),
            fix=Fix(summary="Build CPU tensors in the Dataset/collate_fn and move the whole batch in the "
                            "training loop: pin_memory=True, .to(device, non_blocking=True), then num_workers>0.",
                    config={"pin_memory": True, "non_blocking": True, "num_workers": 4}),
        )
