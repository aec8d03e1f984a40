"""gpu-idle: the share of each step the GPU runs nothing, and what the host did meanwhile."""
from __future__ import annotations

from typing import Any

import numpy as np

from auditor.evidence.trace.decode import CAT, CPU_NESTING, GPU_WORK
from auditor.evidence.trace.intervals import intersect, merge_intervals, subtract, total_length
from auditor.evidence.trace.model import Trace
from auditor.evidence.trace.queries import DATALOADER_NEXT, blocking_calls, frame_location_parts, gpu_busy
from auditor.rules.base import Option, Options, TraceRule
from auditor.findings import Cost, Finding, Fix, Location

_CAUSES = {
    "data loading": Fix(summary="Load data in parallel and ahead of the GPU: DataLoader(num_workers>0, "
                                "pin_memory=True, persistent_workers=True).",
                        config={"num_workers": 4, "pin_memory": True, "persistent_workers": True}),
    "host synchronisation": Fix(summary="Remove device->host syncs from the step (.item(), .cpu(), "
                                        "torch.cuda.synchronize(), data-dependent shapes); see host-sync.",
                                config={"non_blocking": True}),
    "host work": Fix(summary="The host cannot issue work fast enough: fuse ops with torch.compile, capture "
                             "the step in CUDA graphs (mode='reduce-overhead'), or move Python work off the step.",
                     config={"torch.compile": {"mode": "reduce-overhead"}}),
    "nothing traced": Fix(summary="The host was outside every traced event (other threads or processes, "
                                  "or the profiler did not record them): profile with with_stack=True to see it."),
}


class GpuIdle(TraceRule):
    """
    What it detects:
        From a profiler trace: the union of kernel, copy and memset time on every stream, against the
        wall time of the profiled steps. It reports the idle share, the largest gaps and what the host
        was doing during the idle time: data loading (`DataLoader.__next__`), synchronising with the
        GPU, other host work (Python, operator dispatch), or nothing the profiler recorded.
        Idle time goes to the first of these that covers it, in that order. "Synchronising" is
        idle time while a sync call is still running: the sync waited on something the trace
        shows no GPU work for (the device busy with another process's work, say). The idle time
        a sync usually causes comes after it returns, while the host issues the next work, and
        counts as host work: in the recorded traces syncs wait on a busy GPU (the small A100
        item/event/device-sync trace: under 1% of its idle time is inside a sync), and
        host-sync is the rule that names them.

    Why it costs:
        An idle GPU is paid for and does nothing. Any idle share is time a faster input pipeline,
        fewer syncs or less host overhead could give back.

    Example:
        for x, y in DataLoader(ds, num_workers=0):   # the GPU waits while the host decodes the batch
            loss = model(x.cuda()).sum()
            print(loss.item())                       # ... and again after each step

    Fix:
        Depends on the cause the finding names: more DataLoader workers and pinned memory for data
        loading; fewer syncs for synchronisation; torch.compile / CUDA graphs for host overhead.

    Evidence needed:
        A profiler trace with CUDA activity, ideally spanning whole ProfilerSteps.
    """

    id = "gpu-idle"
    title = "GPU idle for much of the step"
    severity = "warning"
    options = (
        Option("min-idle-share", 0.3, "Report when the GPU is idle at least this share of the profiled steps."),
        Option("gaps", 5, "How many of the largest idle gaps to describe."),
    )

    def check_trace(self, trace: Trace, options: Options) -> Finding | None:
        if not np.isin(trace.col("cat"), GPU_WORK).any():
            return None  # a CPU-only trace says nothing about GPU idleness
        lo, hi = trace.window()
        span = hi - lo
        if span <= 0:
            return None
        busy = gpu_busy(trace, lo, hi)
        whole = (np.array([lo]), np.array([hi]))
        idle = subtract(whole, busy)
        idle_us = total_length(idle)
        share = idle_us / span
        if share < options.min_idle_share:
            return None
        steps = trace.step_count()

        # numpy columns, not DataFrame slices: these masks cover millions of rows on big traces
        cat, names, ts, end = trace.col("cat"), trace.col("name"), trace.col("ts"), trace.col("end")
        cpu = np.isin(cat, CPU_NESTING) & ~trace.col("instant")
        loader = cpu & np.isin(names, trace.symbols.matching(DATALOADER_NEXT))
        syncs = np.zeros(len(cat), dtype=bool)
        syncs[blocking_calls(trace)] = True
        top = cpu & (trace.col("parent") < 0)  # children lie inside their parents: same union, fewer rows
        loader_iv = merge_intervals(ts[loader], end[loader])
        sync_iv = merge_intervals(ts[syncs], end[syncs])
        host_iv = merge_intervals(ts[top], end[top])
        by_data = intersect(idle, loader_iv)
        rest = subtract(idle, loader_iv)
        by_sync = intersect(rest, sync_iv)
        rest = subtract(rest, sync_iv)
        by_host = intersect(rest, host_iv)
        untraced = total_length(rest) - total_length(by_host)
        breakdown = {"data loading": total_length(by_data), "host synchronisation": total_length(by_sync),
                     "host work": total_length(by_host), "nothing traced": max(untraced, 0.0)}
        cause = max(breakdown, key=lambda k: breakdown[k])

        gaps = self._largest_gaps(trace, idle, lo, int(options.gaps))
        locations = []
        for g in gaps:
            if g.get("file") and not any(loc.file == g["file"] and loc.line == g["line"] for loc in locations):
                locations.append(Location(g["file"], g["line"], g.pop("code", "")))
            g.pop("code", None)
        per_step_ms = idle_us / 1000.0 / steps
        biggest = gaps[0]["ms"] if gaps else 0.0
        # (its share of the step is the cost's, which TraceRule.check takes of the step the
        # report states; a share of this window printed here would be a second number for it)
        message = (f"The GPU was idle {per_step_ms:.1f} ms per step in {trace.label}; the largest gap "
                   f"is {biggest:.1f} ms and most idle time overlaps {cause} "
                   f"({breakdown[cause] / idle_us:.0%} of it).")
        return self.finding(
            message,
            locations=locations,
            evidence={"trace": str(trace.path), "steps": steps, "window_ms": round(span / 1000.0, 3),
                      "busy_share": round(1.0 - share, 4), "idle_share": round(share, 4),
                      "idle_ms_per_step": round(per_step_ms, 3), "cause": cause,
                      "idle_by_cause_ms_per_step": {k: round(v / 1000.0 / steps, 3) for k, v in breakdown.items()},
                      "largest_gaps": gaps},
            cost=Cost(ms_per_step=round(per_step_ms, 3), share_of_step=None, measured=True,
                      note="idle time of all GPU streams together"),
            fix=_CAUSES[cause],
        )

    @staticmethod
    def _largest_gaps(trace: Trace, idle: tuple[np.ndarray, np.ndarray], lo: float,
                      count: int) -> list[dict[str, Any]]:
        """The longest idle gaps with the host event that covered most of each."""
        starts, ends = idle
        order = np.argsort(-(ends - starts))[:max(count, 0)]
        kinds = (CAT["cpu_op"], CAT["annotation"], CAT["runtime"], CAT["driver"])
        mask = np.isin(trace.col("cat"), kinds) & ~trace.col("instant")
        mask &= ~np.isin(trace.col("name"), trace.symbols.matching(r"^ProfilerStep#"))
        rows = np.flatnonzero(mask)
        ts, end = trace.col("ts")[rows], trace.col("end")[rows]
        by_start = np.argsort(ts, kind="stable")
        ts_sorted = ts[by_start]
        out = []
        for i in order:
            s, e = float(starts[i]), float(ends[i])
            # candidates: events starting before the gap ends, still running after it starts
            upto = by_start[:np.searchsorted(ts_sorted, e, side="left")]
            cand = upto[end[upto] > s]
            gap: dict[str, Any] = {"start_ms": round((s - lo) / 1000.0, 3), "ms": round((e - s) / 1000.0, 3)}
            if len(cand):
                cover = np.minimum(end[cand], e) - np.maximum(ts[cand], s)
                row = int(rows[cand[np.argmax(cover)]])
                gap["host"] = trace.name(row)
                gap["host_share"] = round(float(cover.max()) / (e - s), 3)
                f = trace.user_frame(row)
                if f is not None:
                    gap["file"], gap["line"], gap["code"], note = frame_location_parts(f)
                    if note:
                        gap["note"] = note
            out.append(gap)
        return out
