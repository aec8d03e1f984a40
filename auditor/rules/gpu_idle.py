"""gpu-idle: the share of each step the GPU runs nothing, and what it waited on in each gap."""
from __future__ import annotations

from typing import Any

import numpy as np

import msgspec

from auditor.evidence.trace.decode import CAT, GPU_WORK
from auditor.evidence.trace.gaps import CAUSES, HOST_CAUSES, QUEUED_KINDS, Gaps, GapSummary, gap_table, summarize
from auditor.evidence.trace.intervals import subtract, total_length
from auditor.evidence.run_time import trace_base_ms
from auditor.evidence.trace.model import Trace
from auditor.evidence.trace.queries import frame_location_parts, gpu_busy
from auditor.rules.base import Option, Options, TraceRule
from auditor.rules._support.short_kernels import short_kernels
from auditor.findings import Cost, Finding, Fix, Location, step_basis_ms, with_share

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
    "launch": Fix(summary="The GPU waits on kernel launches: fuse ops with torch.compile, capture the step in CUDA "
                          "graphs (mode='reduce-overhead'), use foreach/fused optimizers.",
                  config={"torch.compile": {"mode": "reduce-overhead"}}),
    "queued work": Fix(summary="The GPU had its next work queued and waited on a dependency, not on the host: find "
                               "what that work waits for (a collective or copy on another stream, an event wait, a "
                               "CUDA graph's inputs) and overlap it with compute, e.g. prefetch the next batch's "
                               "transfers on a side stream; host-side fixes do not give this idle back."),
    "untraced": Fix(summary="The trace does not show what the GPU waited for (its next work was launched before the "
                            "profiler started, or nothing followed): profile a longer window to see it."),
}
_HOST_BOUND = Fix(summary="The host cannot issue the step's work as fast as the GPU runs it: issue fewer, larger "
                          "launches. Capture the step in CUDA graphs (torch.compile(mode=\"reduce-overhead\"), or "
                          "torch.cuda.graphs), give each launch more work (a larger batch), or launch fewer small ops "
                          "(fused ops, foreach/fused optimizers).",
                  config={"torch.compile": {"mode": "reduce-overhead"}})
# The message's opening sentence by the cause most of the idle has: what, and what to do.
_LEADS = {"data loading": "The GPU waits for data: load it in DataLoader workers.",
          "host synchronisation": "The GPU waits behind host syncs: read values less often.",
          "host work": "The GPU waits on the host's work: use CUDA graphs.",
          "launch": "The GPU waits on kernel launches: fuse ops or use CUDA graphs.",
          "queued work": "The GPU waits on queued work: overlap what that work waits for.",
          "untraced": "The GPU idles for reasons the trace does not show: profile longer."}
_ISSUING = ("host work", "launch")  # the host issuing the step's work: what a host-bound step waits on
_PHRASES = {"queued work": "waiting on work already queued",
            "host synchronisation": "behind host synchronisation (from a sync until the host's next launch)",
            "data loading": "data loading", "host work": "host work before the next launch",
            "launch": "kernel launches", "untraced": "not explained by the trace"}


class _Idle(msgspec.Struct):
    """A trace window's GPU idle time, by cause, calibrated to the run's step."""
    steps: int
    span: float  # the window, us
    share: float  # of the window the GPU was idle
    idle_us: float
    summary: GapSummary
    breakdown: dict[str, float]  # idle us in the window, by cause
    cause: str
    gaps: list[dict[str, Any]]
    locations: list[Location]
    window_ms: float  # idle per step in the window
    busy_ms: float
    scale: float
    per_step_ms: float  # idle per step, calibrated
    by_cause: dict[str, float]
    claim_ms: float
    queued_ms: float
    untraced_ms: float
    biggest: float
    short: dict[str, Any] | None
    issuing_ms: float
    host_bound: bool



class GpuIdle(TraceRule):
    """
    What it detects:
        From a profiler trace: the union of kernel, copy and memset time on every stream, against
        the wall time of the profiled steps. It reports the idle share, the largest gaps and why
        the GPU waited in each, read from the launch queue: work that was already queued when a
        gap began means the GPU waited on a dependency (another stream, an event, a collective, a
        graph); work launched late means it waited on the host, split by what the launching thread
        did first: data loading, a host synchronisation, other host work, the launch itself. Idle
        the trace cannot explain is `untraced`.
        Its cost counts only the idle the host caused, per step of the run's time: the profiled
        steps run longer (the profiler slows the host, not the kernels), so the idle per step is
        at most the run's time per step less the GPU's own work.
        Host-bound: when the host's issuing of work is most of that idle and at least
        `host-bound-short-share` of the kernels (`host-bound-min-kernels-per-step` or more a
        step) run shorter than their launch, no edit of one line gives the idle back; the finding
        says so, as info, and counts no time in the headline.

    Why it costs:
        An idle GPU is paid for and does nothing. Any idle share is time a faster input pipeline,
        fewer syncs or less host overhead could give back.

    Example:
        for x, y in DataLoader(ds, num_workers=0):   # the GPU waits while the host decodes the batch
            loss = model(x.cuda()).sum()
            print(loss.item())                       # ... and again after each step

    Fix:
        Depends on the cause the finding names: more DataLoader workers and pinned memory for data
        loading; fewer syncs for synchronisation; torch.compile / CUDA graphs for host overhead and
        launches; for queued work, overlap what the queued work waits for (no host-side change); for
        a host-bound step, CUDA graphs (torch.compile(mode="reduce-overhead")), a larger batch,
        fewer small ops.

    Evidence needed:
        A profiler trace with CUDA activity, ideally spanning whole ProfilerSteps.
    """

    id = "gpu-idle"
    reads = frozenset({"with_stack"})  # (the user's line of a gap)
    title = "GPU idle for much of the step"
    severity = "warning"
    shares = ("gap table",)  # auditor.evidence.trace.gaps.gap_table
    options = (
        Option("min-idle-share", 0.3, "Report when the GPU is idle at least this share of the run's time (the "
                                      "profiled steps', calibrated to the run's time per step)."),
        Option("gaps", 5, "How many of the largest idle gaps to describe."),
        Option("host-bound-short-share", 0.5,
               "Call the step host-bound when the host's issuing (host work, launches) is most of the idle the "
               "host caused and at least this share of the launched kernels run shorter than their launch ..."),
        Option("host-bound-min-kernels-per-step", 20,
               "... and at least this many per step: a step of a few kernels is not bound by its launch rate."),
    )

    def check(self, evidence: Any, options: Options) -> Any:
        """Each trace judged against the run's time per step its costs are part of (a run's, whose
        profiled window's steps run longer; a recording's own)."""
        for trace in evidence.trace_data:
            finding = self._judge(trace, options, step_basis_ms(evidence, trace))
            if finding is not None:
                yield with_share(finding, step_basis_ms(evidence, trace))

    def check_trace(self, trace: Trace, options: Options) -> Finding | None:
        return self._judge(trace, options, trace_base_ms(trace))

    def _judge(self, trace: Trace, options: Options, step_ms: float | None) -> Finding | None:
        i = self._idle(trace, options, step_ms)
        if i is None:
            return None
        steps, share, idle_us, summary, breakdown, cause = i.steps, i.share, i.idle_us, i.summary, i.breakdown, i.cause
        gaps, locations, window_ms, busy_ms, scale, per_step_ms = i.gaps, i.locations, i.window_ms, i.busy_ms, i.scale, i.per_step_ms
        by_cause, claim_ms, queued_ms, untraced_ms, biggest = i.by_cause, i.claim_ms, i.queued_ms, i.untraced_ms, i.biggest
        short, issuing_ms, host_bound, span = i.short, i.issuing_ms, i.host_bound, i.span
        evidence = {"trace": str(trace.path), "steps": steps, "window_ms": round(span / 1000.0, 3),
                    "busy_share": round(1.0 - share, 4), "idle_share": round(share, 4),
                    "idle_ms_per_step": round(per_step_ms, 3), "window_idle_ms_per_step": round(window_ms, 3),
                    "busy_ms_per_step": round(busy_ms, 3), "step_ms": round(step_ms, 3) if step_ms else None,
                    "calibration": round(scale, 4), "cause": cause,
                    "verdict": "host-bound" if host_bound else cause,
                    "idle_by_cause_ms_per_step": by_cause,
                    "queued_by_ms_per_step": summary.queued_by_ms_per_step,
                    "recoverable_ms_per_step": round(claim_ms, 3), "untraced_ms_per_step": untraced_ms,
                    "gap_causes": [msgspec.to_builtins(c) for c in summary.causes],
                    "largest_gaps": gaps}
        scaled = ""
        if scale < 1.0:
            scaled = (f" (the profiled window held {window_ms:.1f} ms of idle per step, more than the "
                      f"{step_ms:.2f} ms of the run's time per step less the GPU's {busy_ms:.2f} ms of work: scaled to it)")
        if host_bound:
            assert short is not None
            per_step_short = short["n_short"] / steps
            evidence.update({"short_kernels_per_step": round(per_step_short, 1),
                             "short_share": round(short["share"], 4), "issuing_ms_per_step": round(issuing_ms, 3)})
            message = ("The host cannot keep the GPU busy: use CUDA graphs. "
                       f"The step is host-bound: the GPU works {busy_ms:.2f} ms of each "
                       f"{step_ms or per_step_ms + busy_ms:.2f} ms step. In {trace.label} it is idle "
                       f"{per_step_ms:.2f} ms{scaled}, "
                       f"{issuing_ms:.2f} ms of it while the host issues the next work (Python, operator dispatch, "
                       f"launches); {per_step_short:.0f} kernels per step ({short['share']:.0%} of those launched) "
                       "run shorter than their launch. No edit of one line of the loop gives this back: capturing "
                       "the step in CUDA graphs (torch.compile(mode=\"reduce-overhead\")), a larger batch or fewer "
                       f"small ops do; at best the step nears the GPU's {busy_ms:.2f} ms plus the host work those "
                       f"leave, at most {issuing_ms:.2f} ms per step saved (an estimate, not measured).")
            rest_ms = claim_ms - issuing_ms
            if rest_ms >= 0.01:
                # (data loading and syncs are facts of their own rules, with their own costs)
                message += (f" The other {rest_ms:.2f} ms per step of the host's idle is data loading and syncs "
                            "(dataloader-bound, host-sync).")
            return self.finding(
                message, severity="info", title="The step is host-bound: the GPU waits on the host issuing work",
                locations=locations, evidence=evidence,
                cost=Cost(ms_per_step=None, share_of_step=None, measured=False,
                          note=f"estimate: up to {issuing_ms:.2f} ms per step, given back only by CUDA graphs, "
                               "larger batches or fewer small ops, not by an edit of the loop's lines"),
                fix=_HOST_BOUND)
        # (its share of the step is the cost's, which TraceRule.check takes of the step the
        # report states; a share of this window printed here would be a second number for it)
        of_run = f", {per_step_ms / step_ms:.0%} of the run's time" if step_ms else ""
        message = (f"{_LEADS[cause]} The GPU is idle {per_step_ms:.1f} ms a step, most of it {_PHRASES[cause]}. "
                   f"In {trace.label}{of_run}{scaled}: the largest gap is {biggest:.1f} ms and most idle time is "
                   f"{_PHRASES[cause]} ({breakdown[cause] / idle_us:.0%} of it).")
        if queued_ms >= 0.01:
            kinds = sorted(((ms, k) for k, ms in summary.queued_by_ms_per_step.items() if ms >= 0.05), reverse=True)
            message += (f" For {queued_ms:.1f} ms per step the next GPU work was already queued (launched before "
                        f"the gap began: {', '.join(f'{k} {ms:.1f} ms' for ms, k in kinds)}): the GPU waited on a "
                        "dependency, not on the host, and that idle is not counted as recoverable.")
        if claim_ms < per_step_ms - 0.0005:
            message += (f" The host's causes (data loading, syncs, host work, launches) account for "
                        f"{claim_ms:.1f} ms per step: what host-side fixes can give back.")
        return self.finding(
            message,
            locations=locations,
            evidence=evidence,
            cost=Cost(ms_per_step=round(claim_ms, 3), share_of_step=None, measured=True,
                      note="idle time of all GPU streams together that the host caused (data loading, syncs, "
                           "host work, launches); idle with the next GPU work already queued (a dependency) "
                           "or that the trace does not explain is not counted"),
            fix=_CAUSES[cause],
        )

    def _idle(self, trace: Trace, options: Options, step_ms: float | None) -> _Idle | None:
        """The window's GPU idle by cause, where it passes the rule's shares (else None)."""
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
        table = gap_table(trace)
        summary = summarize(trace, table)
        breakdown = dict(zip(CAUSES, table.us.sum(axis=0).tolist()))  # us in the window
        cause = max(breakdown, key=lambda k: breakdown[k])

        gaps = self._largest_gaps(trace, idle, lo, int(options.gaps))
        _add_causes(trace, table, gaps, lo)
        locations = []
        for g in gaps:
            if g.get("file") and not any(loc.file == g["file"] and loc.line == g["line"] for loc in locations):
                locations.append(Location(g["file"], g["line"], g.pop("code", ""), g.get("note", "")))
            g.pop("code", None)
        window_ms = idle_us / 1000.0 / steps
        busy_ms = total_length(busy) / 1000.0 / steps
        # Calibration: the GPU's own work per step is what it is inside or outside the profiler, the
        # host's is slowed there (the profiler, a run's checks), so the idle of a step is at most the
        # step the costs are part of less the GPU's work; the window's idle, each cause alike, is
        # scaled down to it when it exceeds that.
        ceiling = max(0.0, step_ms - busy_ms) if step_ms else None
        scale = min(1.0, ceiling / window_ms) if ceiling is not None and window_ms > 0 else 1.0
        per_step_ms = window_ms * scale
        if step_ms and per_step_ms / step_ms < options.min_idle_share:  # (of the run's time per step)
            return None
        by_cause = {c.cause: round(c.ms_per_step * scale, 3) for c in summary.causes}
        claim_ms = sum(by_cause[c] for c in HOST_CAUSES)
        queued_ms, untraced_ms = by_cause["queued work"], by_cause["untraced"]
        biggest = gaps[0]["ms"] if gaps else 0.0
        short = short_kernels(trace)
        issuing_ms = sum(by_cause[c] for c in _ISSUING)
        host_bound = (short is not None and short["share"] >= options.host_bound_short_share
                      and short["n_short"] / steps >= options.host_bound_min_kernels_per_step
                      and claim_ms > 0 and issuing_ms >= 0.5 * claim_ms)
        return _Idle(steps=steps, span=span, share=share, idle_us=idle_us, summary=summary, breakdown=breakdown,
                     cause=cause, gaps=gaps, locations=locations, window_ms=window_ms, busy_ms=busy_ms, scale=scale,
                     per_step_ms=per_step_ms, by_cause=by_cause, claim_ms=claim_ms, queued_ms=queued_ms,
                     untraced_ms=untraced_ms, biggest=biggest, short=short, issuing_ms=issuing_ms,
                     host_bound=host_bound)

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


def _add_causes(trace: Trace, table: Gaps, gaps: list[dict[str, Any]], lo: float) -> None:
    """Each described gap's main cause, and for one whose next GPU work was already queued, how
    long before the gap that work was launched and how (`queued_ms_before`, `queued_by`)."""
    ts = trace.col("ts")
    for g in gaps:
        i = int(np.argmin(np.abs(table.start - (lo + g["start_ms"] * 1000.0))))
        g["cause"] = CAUSES[int(np.argmax(table.us[i]))]
        launch = int(table.launch_row[i])
        if g["cause"] == "queued work" and table.queued_kind[i] >= 0:
            g["queued_by"] = QUEUED_KINDS[int(table.queued_kind[i])]
            if launch >= 0 and trace.col("end")[launch] <= table.start[i]:
                g["queued_ms_before"] = round((float(table.start[i]) - float(ts[launch])) / 1000.0, 3)
                g["launch"] = trace.name(launch)
