"""launch-bound: the GPU waiting on the host's launches: gaps that end with a late launch, and kernels that run
shorter than the host call that launches them."""
from __future__ import annotations

from collections import Counter

import numpy as np

from auditor.evidence.trace.decode import CAT
from auditor.evidence.trace.gaps import gap_table
from auditor.evidence.trace.model import Trace
from auditor.evidence.trace.names import COMM_KERNEL, GRAPH_LAUNCH
from auditor.evidence.trace.queries import frame_location_parts, issuing_op, sites
from auditor.rules.base import Option, Options, TraceRule
from auditor.findings import Cost, Finding, Fix, Location


class LaunchBound(TraceRule):
    """
    What it detects:
        Two signs that the GPU waits on the host's launches, in a profiler trace.
        Launch-starved idle: gaps of the device timeline shorter than `max-gap-us` that end with
        an op whose launch had not returned when the GPU ran out of work (its launch began after
        the gap began; auditor.evidence.trace.gaps), less what data loading and syncs explain:
        the host's work before each launch call and the call itself. Reported when there are at
        least `min-gaps-per-step` such gaps per step AND their idle is at least
        `min-starved-share` of the median step, with that idle as the measured cost. On the A100
        DDP recording (rank 0) 848 gaps a step, median 92 us, add up to 117.21 ms of a 222 ms step
        (107.41 ms of host work before the launch calls, 9.80 ms in them), while only 38% of its
        kernels run shorter than their launch.
        Short kernels: kernels whose GPU duration is shorter than the `cudaLaunchKernel` /
        `hipLaunchKernel` (or driver) call that launched them, matched through CUPTI correlation
        ids, with their count per step, their share of all launched kernels, and the operators and
        source lines that launch the most. Kernels replayed from a CUDA/HIP graph are left out (one
        graph launch pays for all of them), and so are communication kernels (NCCL/RCCL: their
        time is set by their peers). Reported when there are at least `min-kernels-per-step` such
        kernels per step AND they are at least `min-share` of all launched kernels. The share is
        the judgement: while most kernels outlast their launch, the work already queued keeps the
        GPU fed through the short ones and their launch cost stays hidden. Counting alone would
        flag the H100 OWLv2 recording (1,331 of 4,330 kernels in its one step run shorter than
        their launch), but that is 31% of its kernels, their launches outlast them by 3.0 ms in all
        in a 1.2 s step, its launch-starved gaps are 8.4 ms (0.7% of the step), and that step's
        GPU idle time is spent waiting for data (gpu-idle, dataloader-bound): quiet.

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
        A profiler trace with CUDA or ROCm activity (kernels and the runtime calls that launched them).
    """

    id = "launch-bound"
    title = "The GPU waits on kernel launches"
    severity = "warning"
    options = (
        Option("min-kernels-per-step", 100,
               "Report when at least this many kernels per step run shorter than their launch."),
        Option("min-share", 0.5, "... and they are at least this share of all launched kernels."),
        Option("max-gap-us", 1000.0,
               "Launch-starved idle: gaps shorter than this (us) whose next op's launch began after the gap began."),
        Option("min-gaps-per-step", 100, "Report launch-starved idle when at least this many such gaps per step ..."),
        Option("min-starved-share", 0.2, "... and their idle is at least this share of the median step."),
    )

    def check_trace(self, trace: Trace, options: Options) -> Finding | None:
        steps = trace.step_count()
        short = self._short_kernels(trace)
        starved = self._starved(trace, options)
        short_fires = short is not None and (short["n_short"] / steps >= options.min_kernels_per_step
                                             and short["share"] >= options.min_share)
        if not short_fires and starved is None:
            return None
        evidence: dict = {"trace": str(trace.path), "steps": steps}
        sentences, where_rows, where_weights = [], [], []
        if short is not None:
            n_short, share, kdur, ldur, is_short = (short["n_short"], short["share"], short["kdur"], short["ldur"],
                                                    short["short"])
            evidence.update({"kernels": len(kdur), "short_kernels": n_short, "short_per_step": round(n_short / steps, 1),
                             "short_share": round(share, 4), "graph_kernels": short["graph"],
                             "comm_kernels": short["comm"], "kernels_under_5us": short["under_5us"],
                             "median_short_kernel_us": float(np.median(kdur[is_short])) if n_short else None,
                             "median_launch_us": float(np.median(ldur[is_short])) if n_short else None})
        if short_fires:
            short_launch = short["launch"][short["short"]]
            ops = Counter(issuing_op(trace, int(r)) or "(no operator)" for r in short_launch)  # memoised per call path
            sentences.append(
                f"{n_short / steps:.0f} kernels per step ({share:.0%} of launched kernels) in "
                f"{trace.label} run shorter than the host call that launches them (median kernel "
                f"{np.median(kdur[is_short]):.1f} us vs launch {np.median(ldur[is_short]):.1f} us); "
                f"most come from {', '.join(n for n, _ in ops.most_common(3))}.")
            evidence["ops"] = dict(ops.most_common(8))
            where_rows, where_weights = list(short_launch), None
        if starved is not None:
            ops = starved["ops"]
            lead = "" if short_fires else f"In {trace.label} the"
            sentences.append(
                (f"{lead} GPU waited on kernel launches {starved['ms_per_step']:.1f} ms per step "
                 if lead else f"The GPU waited on kernel launches {starved['ms_per_step']:.1f} ms per step ")
                + f"({starved['share']:.0%} of the median step): {starved['per_step']:.0f} gaps per step, each "
                f"under {options.max_gap_us / 1000:g} ms, where the GPU ran out of work before the next op was "
                f"launched (median gap {starved['median_us']:.0f} us; {starved['host_ms']:.1f} ms per "
                f"step of host work before the launch calls, {starved['launch_ms']:.1f} ms in them); most follow "
                f"launches from {', '.join(n for n, _ in ops.most_common(3))}.")
            evidence.update({"starved_gaps": starved["gaps"], "starved_per_step": round(starved["per_step"], 1),
                             "starved_ms_per_step": round(starved["ms_per_step"], 3),
                             "starved_share": round(starved["share"], 4),
                             "starved_host_ms_per_step": round(starved["host_ms"], 3),
                             "starved_launch_ms_per_step": round(starved["launch_ms"], 3),
                             "median_starved_gap_us": round(starved["median_us"], 3),
                             "max_gap_us": float(options.max_gap_us), "starved_ops": dict(ops.most_common(8))})
            where_rows, where_weights = starved["launches"], starved["weights"]
        where = sites(trace, where_rows, weights=where_weights)
        evidence["sites"] = [{"file": f.file, "line": f.line, "kernels": n} for f, n, _ in where]
        if starved is not None:
            cost = Cost(ms_per_step=round(starved["ms_per_step"], 3), share_of_step=None, measured=True,
                        note=f"GPU idle in gaps under {options.max_gap_us / 1000:g} ms that waited on the next launch "
                             "(the host was late): what faster launches give back at most",
                        within="gpu-idle")
        else:
            excess_ms = float(np.clip(ldur[is_short] - kdur[is_short], 0, None).sum()) / 1000.0 / steps
            cost = Cost(ms_per_step=round(excess_ms, 3), share_of_step=None,  # (TraceRule.check sets it)
                        measured=False, note="estimate: launch time the short kernels cannot hide")
        return self.finding(
            " ".join(sentences),
            locations=[Location(*frame_location_parts(f)) for f, _, _ in where],
            evidence=evidence,
            cost=cost,
            fix=Fix(summary="Give kernels more work or fewer launches: larger batches, fused ops "
                            "(foreach/fused optimizers), torch.compile, CUDA graphs.",
                    config={"torch.compile": {"mode": "reduce-overhead"}, "optimizer": {"foreach": True}}),
        )

    @staticmethod
    def _short_kernels(trace: Trace) -> dict | None:
        """Kernels launched one by one (not from a graph, not communication) against their launch calls."""
        ev = trace.events
        kernels = ev[(ev["cat"] == CAT["kernel"]) & (ev["link"] >= 0)]
        if not len(kernels):
            return None
        launch = kernels["link"].to_numpy()
        launch_names = ev["name"].to_numpy()[launch]
        graph = np.isin(launch_names, trace.symbols.matching(GRAPH_LAUNCH))
        # a collective's duration is set by its peers, not by its launch
        comm = np.isin(kernels["name"].to_numpy(), trace.symbols.matching(COMM_KERNEL))
        keep = ~graph & ~comm
        kdur = kernels["dur"].to_numpy()[keep]
        launch = launch[keep]
        if not len(launch):
            return None
        ldur = ev["dur"].to_numpy()[launch]
        short = kdur < ldur
        return {"n_short": int(short.sum()), "share": float(short.sum()) / len(kdur), "kdur": kdur, "ldur": ldur,
                "short": short, "launch": launch, "graph": int(graph.sum()), "comm": int(comm.sum()),
                "under_5us": int((kernels["dur"].to_numpy() < 5.0).sum())}

    @staticmethod
    def _starved(trace: Trace, options: Options) -> dict | None:
        """The launch-starved gaps (auditor.evidence.trace.gaps): shorter than max-gap-us, the next
        op's launch begun after the gap began; None unless they pass both thresholds."""
        table = gap_table(trace)
        idle = table.of("host work") + table.of("launch")
        pick = (table.end - table.start < float(options.max_gap_us)) & (idle > 0)
        steps = trace.step_count()
        n = int(pick.sum())
        ms = float(idle[pick].sum()) / 1000.0 / steps
        step_ms = trace.median_step_ms()
        share = ms / step_ms if step_ms > 0 else 0.0
        if n / steps < options.min_gaps_per_step or share < options.min_starved_share:
            return None
        launches = table.launch_row[pick]
        ops = Counter(issuing_op(trace, int(r)) or "(no operator)" for r in launches)
        return {"gaps": n, "per_step": n / steps, "ms_per_step": ms, "share": share,
                "median_us": float(np.median((table.end - table.start)[pick])),
                "host_ms": float(table.of("host work")[pick].sum()) / 1000.0 / steps,
                "launch_ms": float(table.of("launch")[pick].sum()) / 1000.0 / steps,
                "ops": ops, "launches": list(launches), "weights": list(idle[pick])}
