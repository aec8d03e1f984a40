"""launch-bound: kernels that run shorter than the host call that launches them."""
from __future__ import annotations

from collections import Counter

import numpy as np

from auditor.evidence.trace.decode import CAT
from auditor.evidence.trace.model import Trace
from auditor.evidence.trace.queries import frame_location_parts, issuing_op, sites
from auditor.rules.base import Option, Options, TraceRule
from auditor.findings import Cost, Finding, Fix, Location

_GRAPH_LAUNCH = r"^(cudaGraphLaunch|cuGraphLaunch|hipGraphLaunch)"


class LaunchBound(TraceRule):
    """
    What it detects:
        Kernels in a profiler trace whose GPU duration is shorter than the `cudaLaunchKernel` (or
        driver) call that launched them, matched through CUPTI correlation ids, with their count per
        step, their share of all kernels, and the operators and source lines that launch the most.
        Kernels replayed from a CUDA graph are left out: one graph launch pays for all of them.
        It reports only when there are at least `min-kernels-per-step` such kernels per step AND
        they are at least `min-share` of all launched kernels. The share is the judgement: while
        most kernels outlast their launch, the work already queued keeps the GPU fed through the
        short ones and their launch cost stays hidden. Counting alone would flag the H100 OWLv2
        recording (1,331 of 4,330 kernels in its one step run shorter than their launch), but that
        is 31% of its kernels, their launches outlast them by 3.0 ms in all in a 1.2 s step, and
        that step's GPU idle time is spent waiting for data (gpu-idle, dataloader-bound): quiet.

    Why it costs:
        When each kernel takes less time than its launch, the GPU finishes it and waits for the next:
        throughput is set by the host's launch rate, not by the GPU, and a faster GPU does not help.

    Example:
        for p in model.parameters():          # hundreds of tiny elementwise kernels per step
            p.data.mul_(0.999).add_(p.grad, alpha=-lr)

    Fix:
        Give each kernel more work (a larger batch), use fused implementations (`foreach=True` /
        `fused=True` optimizers, fused attention), `torch.compile` to fuse elementwise chains, or
        capture the step in CUDA graphs (`torch.compile(mode="reduce-overhead")`).

    Evidence needed:
        A profiler trace with CUDA activity (kernels and the runtime calls that launched them).
    """

    id = "launch-bound"
    title = "Kernels shorter than their launch"
    severity = "warning"
    options = (
        Option("min-kernels-per-step", 100,
               "Report when at least this many kernels per step run shorter than their launch."),
        Option("min-share", 0.5, "... and they are at least this share of all launched kernels."),
    )

    def check_trace(self, trace: Trace, options: Options) -> Finding | None:
        ev = trace.events
        kernels = ev[(ev["cat"] == CAT["kernel"]) & (ev["link"] >= 0)]
        if not len(kernels):
            return None
        launch = kernels["link"].to_numpy()
        launch_names = ev["name"].to_numpy()[launch]
        graph = np.isin(launch_names, trace.symbols.matching(_GRAPH_LAUNCH))
        kdur = kernels["dur"].to_numpy()[~graph]
        launch = launch[~graph]
        if not len(launch):
            return None
        ldur = ev["dur"].to_numpy()[launch]
        short = kdur < ldur
        n_short = int(short.sum())
        steps = trace.step_count()
        share = n_short / len(kdur)
        if (n_short / steps < options.min_kernels_per_step
                or share < options.min_share):
            return None
        short_launch = launch[short]
        ops = Counter(issuing_op(trace, int(r)) or "(no operator)" for r in short_launch)  # memoised per call path
        where = sites(trace, short_launch)
        excess_ms = float(np.clip(ldur[short] - kdur[short], 0, None).sum()) / 1000.0 / steps
        message = (f"{n_short / steps:.0f} kernels per step ({share:.0%} of launched kernels) in "
                   f"{trace.label} run shorter than the host call that launches them (median kernel "
                   f"{np.median(kdur[short]):.1f} us vs launch {np.median(ldur[short]):.1f} us); "
                   f"most come from {', '.join(n for n, _ in ops.most_common(3))}.")
        return self.finding(
            message,
            locations=[Location(*frame_location_parts(f)) for f, _, _ in where],
            evidence={"trace": str(trace.path), "steps": steps, "kernels": len(kdur),
                      "short_kernels": n_short, "short_per_step": round(n_short / steps, 1),
                      "short_share": round(share, 4), "graph_kernels": int(graph.sum()),
                      "kernels_under_5us": int((kernels["dur"].to_numpy() < 5.0).sum()),
                      "median_short_kernel_us": float(np.median(kdur[short])),
                      "median_launch_us": float(np.median(ldur[short])),
                      "ops": dict(ops.most_common(8)),
                      "sites": [{"file": f.file, "line": f.line, "kernels": n} for f, n, _ in where]},
            cost=Cost(ms_per_step=round(excess_ms, 3), share_of_step=None,  # (TraceRule.check sets it)
                      measured=False, note="estimate: launch time the short kernels cannot hide"),
            fix=Fix(summary="Give kernels more work or fewer launches: larger batches, fused ops "
                            "(foreach/fused optimizers), torch.compile, CUDA graphs.",
                    config={"torch.compile": {"mode": "reduce-overhead"}, "optimizer": {"foreach": True}}),
        )
