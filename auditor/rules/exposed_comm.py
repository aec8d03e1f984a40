"""exposed-comm: communication kernels the GPU ran with no computation beside them, on one rank's
trace (no other rank needed)."""
from __future__ import annotations

import re
from typing import Any

import numpy as np

from auditor.evidence.trace.decode import CAT
from auditor.evidence.trace.efficiency import COMMUNICATION, comm_args, efficiency
from auditor.evidence.trace.intervals import merge_intervals, subtract, total_length
from auditor.evidence.trace.model import Trace
from auditor.evidence.trace.queries import frame_location_parts, sites
from auditor.findings import Cost, Finding, Fix, Location
from auditor.rules.base import Option, Options, TraceRule

_DTYPE_BYTES = {"float": 4, "half": 2, "bfloat16": 2, "double": 8, "int": 4, "long": 8, "int8": 1, "byte": 1,
                "char": 1, "bool": 1, "uint8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}
# nccl-tests' bus bandwidth: what the link carried, from the algorithm bandwidth (bytes / time) of
# a collective among n ranks (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md).
_BUS_FACTOR = {"allreduce": lambda n: 2 * (n - 1) / n, "allgather": lambda n: (n - 1) / n,
               "reducescatter": lambda n: (n - 1) / n, "alltoall": lambda n: (n - 1) / n,
               "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0}
_KERNEL_COLLECTIVE = re.compile(r"(AllReduce|AllGather|ReduceScatter|Broadcast|Reduce|SendRecv|AllToAll|Send|Recv)",
                                re.IGNORECASE)


def _collective(name: str, recorded: Any) -> str:
    if isinstance(recorded, str) and recorded:
        return recorded.lower().replace("_", "")
    m = _KERNEL_COLLECTIVE.search(name)
    return m.group(1).lower() if m else "other"


class ExposedComm(TraceRule):
    """
    What it detects:
        Communication kernels (`ncclDevKernel_*`, `ncclKernel_*`, rccl) in one rank's profiler
        trace that ran while no computation kernel did: the time the step waited on the network.
        It reports the exposed time per step, the collectives (count, size, time) and the bus
        bandwidth they reached, from this one trace: no other rank's is needed.

    Why it costs:
        DDP and FSDP overlap gradient communication with the backward pass; what is not overlapped
        (the last buckets, a bucket too large to start early, an all-reduce every micro-batch,
        parameters gathered only when needed) adds straight to the step's time.

    Example:
        model = DDP(model)            # 25 MB buckets; the last ones all-reduce after backward ends
        for micro in batches:         # gradient accumulation without no_sync: 4 all-reduces a step
            model(micro).sum().backward()

    Fix:
        Overlap more: smaller DDP buckets so the first start earlier (`bucket_cap_mb`), or larger
        ones for many tiny all-reduces; `gradient_as_bucket_view=True`; accumulate gradients
        under `model.no_sync()` and all-reduce once per optimizer step; FSDP:
        `backward_prefetch=BackwardPrefetch.BACKWARD_PRE`, `forward_prefetch=True`,
        `limit_all_gathers=True`.

    Evidence needed:
        A profiler trace of one rank with its communication kernels (recorded by Kineto).
    """

    id = "exposed-comm"
    saves_on = "device"
    title = "communication not overlapped with compute"
    severity = "warning"
    category = "performance"
    judged_on_device = True
    options = (
        Option("min-share", 0.05, "Report when exposed communication is at least this share of the step."),
        Option("min-ms-per-step", 1.0, "... and at least this many ms per step."),
    )

    def check_trace(self, trace: Trace, options: Options, chosen: str = "") -> Finding | None:
        cat, names, ts, end, dur = (trace.col(c) for c in ("cat", "name", "ts", "end", "dur"))
        codes = trace.symbols.matching(COMMUNICATION)
        if not len(codes):
            return None
        kernels = np.flatnonzero(cat == CAT["kernel"])
        is_comm = np.isin(names[kernels], codes)
        lo, hi = trace.window()
        comm_rows = kernels[is_comm & (ts[kernels] >= lo) & (ts[kernels] < hi)]  # those the steps hold
        if not len(comm_rows):
            return None
        eff = efficiency(trace, chosen)
        steps = len(eff.steps) or 1
        exposed_ms = sum(s.exposed_comm_ms for s in eff.steps) / steps
        comm_ms = sum(s.comm_ms for s in eff.steps) / steps
        step_ms = trace.median_step_ms()
        if exposed_ms < options.min_ms_per_step or (step_ms and exposed_ms / step_ms < options.min_share):
            return None
        compute = merge_intervals(ts[kernels[~is_comm]], end[kernels[~is_comm]])
        recorded = comm_args(trace)
        table: dict[str, dict[str, Any]] = {}
        exposed_of = np.zeros(len(comm_rows))
        for i, r in enumerate(comm_rows.tolist()):
            mine = (np.array([ts[r]]), np.array([end[r]]))
            exposed_of[i] = float(total_length(subtract(mine, compute))) / 1e3
            a = recorded.get(r)
            name = _collective(trace.symbols[int(names[r])], a.collective if a is not None else None)
            row = table.setdefault(name, {"count": 0, "ms": 0.0, "exposed_ms": 0.0, "bytes": 0, "busbw": []})
            row["count"] += 1
            row["ms"] += float(dur[r]) / 1e3
            row["exposed_ms"] += float(exposed_of[i])
            if a is not None and isinstance(a.in_nelems, int) and isinstance(a.dtype, str):
                nbytes = a.in_nelems * _DTYPE_BYTES.get(a.dtype.lower(), 4)
                row["bytes"] += nbytes
                n = a.group_size if isinstance(a.group_size, int) and a.group_size > 1 else None
                factor = _BUS_FACTOR.get(name)
                if n and factor and dur[r] > 0:
                    row["busbw"].append((nbytes / (float(dur[r]) / 1e6) / 1e9 * factor(n), float(dur[r])))
        collectives = {}
        for name, row in sorted(table.items(), key=lambda kv: -kv[1]["exposed_ms"]):
            bw = row.pop("busbw")
            weighted = sum(b * d for b, d in bw) / sum(d for _, d in bw) if bw else None
            collectives[name] = {"count": row["count"], "ms_per_step": round(row["ms"] / steps, 3),
                                 "exposed_ms_per_step": round(row["exposed_ms"] / steps, 3),
                                 "mb_per_step": round(row["bytes"] / steps / 1e6, 3) if row["bytes"] else None,
                                 "bus_gbps": round(weighted, 2) if weighted is not None else None}
        where = sites(trace, comm_rows, weights=exposed_of)
        device = eff.device
        biggest = next(iter(collectives))
        top = collectives[biggest]
        link = ""
        if device is not None and device.nvlink_gbs and top["bus_gbps"]:
            link = (f"; {biggest} reached {top['bus_gbps']:.1f} GB/s of bus bandwidth against the "
                    f"{device.name}'s {device.nvlink_gbs / 2:g} GB/s NVLink per direction")
        message = ("Communication runs with no computation beside it: overlap it with the backward pass. "
                   f"{exposed_ms:.1f} ms per step of communication in {trace.label} ran with no computation "
                   f"beside it ({exposed_ms / comm_ms:.0%} of its {comm_ms:.1f} ms/step of communication kernels"
                   + (f", {exposed_ms / step_ms:.0%} of the step" if step_ms else "") + "): "
                   + ", ".join(f"{k} x{v['count']}" + (f" ({v['mb_per_step']:.1f} MB/step)" if v["mb_per_step"] else "")
                               for k, v in collectives.items()) + link + ".")
        return self.finding(
            message,
            locations=[Location(*frame_location_parts(f)) for f, _, _ in where],
            evidence={"trace": str(trace.path), "steps": steps, "exposed_comm_ms_per_step": round(exposed_ms, 3),
                      "comm_ms_per_step": round(comm_ms, 3),
                      "per_step_exposed_ms": [round(s.exposed_comm_ms, 3) for s in eff.steps],
                      "collectives": collectives, "device": device.key if device else None,
                      "world_size": trace.distributed_info.get("world_size"),
                      "bus_gbps_basis": "bytes over the kernel's whole time, its wait for the other ranks "
                                        "included (nccl-tests' bus bandwidth factors)"},
            cost=Cost(ms_per_step=round(exposed_ms, 3), share_of_step=None, measured=True,
                      note="communication kernel time no other kernel overlapped, per step"),
            fix=Fix(summary="Overlap communication with compute: tune DDP's bucket_cap_mb (smaller buckets start "
                            "all-reducing earlier in backward), accumulate gradients under model.no_sync() and "
                            "all-reduce once per optimizer step, and for FSDP prefetch "
                            "(backward_prefetch=BACKWARD_PRE, forward_prefetch=True).",
                    config={"DistributedDataParallel": {"bucket_cap_mb": 25, "gradient_as_bucket_view": True},
                            "FSDP": {"backward_prefetch": "BACKWARD_PRE", "forward_prefetch": True}}),
        )
