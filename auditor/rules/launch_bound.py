"""launch-bound: the GPU waiting on the host's launches: gaps that end with a late launch, and kernels that run
shorter than the host call that launches them; in CUDA rehearsal, the step's launches of kernels too small to
outlast their launch on the device model's row."""
from __future__ import annotations

import os
from collections import Counter, defaultdict
from typing import Iterable

import numpy as np

from auditor.evidence import model as m
from auditor.evidence.trace.gaps import gap_table
from auditor.evidence.trace.model import Trace
from auditor.evidence.trace.queries import frame_location_parts, issuing_op, sites
from auditor.rules._support.gpu_costs import estimate_device, kernel_us, launch_cost
from auditor.rules._support.places import steps_run, typical_pairs
from auditor.rules._support.cli_flags import own_flag
from auditor.rules._support.short_kernels import short_kernels
from auditor.rules._support.step_edits import loop_around
from auditor.fixes import read_lines
from auditor.rules._support.text import line_ref, per_step
from auditor.rules.base import Option, Options, TraceRule
from auditor.rules.suppression import unsuppressed
from auditor.evidence.step_clock import BACKWARD_FACTOR, backward_factor, device_busy_ms
from auditor.findings import Cost, Finding, Fix, Location, step_basis_ms, with_share

_COMPILE = {"torch.compile": {"mode": "reduce-overhead"}}
# The advice for each cause of the small launches, as the named lines show it (step_edits.loop_around).
_ADVICE = {
    "parameters": "Update the parameters together, not one by one in a Python loop: torch._foreach_* ops over "
                  "the parameter list, or a torch.optim optimizer with foreach=True (or fused=True).",
    "loop": "Batch the per-element loop into whole-tensor ops (nn.RNN/nn.LSTM/nn.GRU for a recurrence, one op "
            "over a stacked tensor for a loop over items), or let torch.compile fuse it.",
    None: "These lines launch small elementwise kernels each time they run: what they compute from shapes "
          "alone (positions, rotary cos/sin, masks that depend only on the sequence length) can be computed "
          "once and reused (a buffer, or a cache keyed by the length); let torch.compile fuse the rest of the "
          "elementwise chain.",
    "trace": "Give kernels more work or fewer launches: larger batches, fused ops, torch.compile.",
}
# a forward (or another function) of the named lines called once per element of a loop in its caller
_CALLER_LOOP = ("These lines run in a function called once per element of the {loops} "
                "({file}): each element launches its kernels again. Batch the elements into one call where one "
                "does not need the one before (a sequence through one nn.GRU/nn.LSTM call rather than a call per "
                "token, the items of a batch stacked), and let torch.compile fuse what must stay a loop.")
_GRAPHS = (" torch.compile(mode=\"reduce-overhead\") also captures the step in CUDA graphs: one launch for all "
           "its kernels.")
_OPTIMIZER_OPS = ("Optimizer.step", "_foreach", "_fused_")


def _fix(files_lines: list[tuple[str | None, int | None]], ops: Iterable[str] = (),
         callers: Iterable[list[tuple[str, int]]] = (), target: str = "", argv: Iterable[str] = ()) -> Fix:
    """The fix for the causes the named lines show: a loop over parameters (foreach ops, and the
    optimizer's foreach setting), another per-element loop (whole-tensor ops), a function called
    per element of a loop in its caller (`callers`: where the user's code called each line's
    function, from a rehearsal; batch the elements), or neither (elementwise ops run once per call:
    cache what depends on shapes alone, fuse the rest). A trace's lines that cannot be read get the
    general advice, with the optimizer's setting only where its own ops launch the kernels. A
    script with a `--compile` option of its own (argparse, in `target` or the lines' files) not
    given on its command line (`argv`) is told to run with it, in place of torch.compile's."""
    callers = list(callers) or [[] for _ in files_lines]
    kinds, looped = [], []
    for (f, n), called in zip(files_lines, callers):
        kind = loop_around(f, n) if f and n and read_lines(f) is not None else "trace"
        if kind in (None, "layers"):  # (run once a call of its function: what runs the function?)
            around = [(c, loop_around(c[0], c[1])) for c in called if read_lines(c[0]) is not None]
            if any(k == "parameters" for _, k in around):
                kind = "parameters"
            elif any(k == "loop" for _, k in around):
                kind = "caller"
                looped.extend(c for c, k in around if k == "loop")
        kinds.append(None if kind == "layers" else kind)
    kinds = list(dict.fromkeys(kinds or ["trace"]))
    config: dict = dict(_COMPILE)
    if "parameters" in kinds or ("trace" in kinds and any(o in op for op in ops for o in _OPTIMIZER_OPS)):
        config["optimizer"] = {"foreach": True}
    looped = list(dict.fromkeys(looped))
    lines = sorted({n for _, n in looped})
    loops = (f"loop around line {lines[0]}" if len(lines) == 1 else
             f"loops around lines {', '.join(map(str, lines[:-1]))} and {lines[-1]}" if lines else "")
    advice = [_CALLER_LOOP.format(loops=loops, file=", ".join(dict.fromkeys(os.path.basename(f) for f, _ in looped)))
              if k == "caller" else _ADVICE[k] for k in kinds]
    flag = own_flag([target, *(f for f, _ in files_lines)], "compile")
    if flag is not None and not any(a.split("=")[0] == flag.option for a in argv):  # the script compiles its model itself when told: its own option is the switch
        config.pop("torch.compile")
        config[flag.option] = flag.usage.partition(" ")[2] or True
        return Fix(summary=" ".join(advice).replace("torch.compile", f"its `{flag.option}`")
                   + f" The script compiles its model with torch.compile itself when run with `{flag.usage}` (its "
                   f"option at line {flag.line} of {os.path.basename(flag.file)}): run it so.", config=config)
    return Fix(summary=" ".join(advice) + _GRAPHS, config=config)


class LaunchBound(TraceRule):
    """
    What it detects:
        Two signs that the GPU waits on the host's launches, in a profiler trace.
        Launch-starved idle: gaps of the device timeline shorter than `max-gap-us` that end with
        an op whose launch had not returned when the GPU ran out of work (evidence.trace.gaps),
        less what data loading and syncs explain. Reported when there are at least
        `min-gaps-per-step` such gaps per step AND their idle is at least `min-starved-share` of
        the median step, with that idle as the measured cost.
        Short kernels: kernels shorter than the call that launched them (graph-replayed and
        communication kernels left out), with the operators and lines that
        launch the most. Reported when there are at
        least `min-kernels-per-step` per step AND they are at least `min-share` of all launched
        kernels: while most kernels outlast their launch, the queued work keeps the GPU fed.
        In CUDA rehearsal (no kernel runs), each torch call of GPU tensors that computes is one
        launch at the user's line (capture.rehearsal.launches), priced on the device model's row
        (`--device`, else the A100 SXM4 80GB): small when its bytes at the row's bandwidth and its
        FLOPs at its peak take less than the row's launch latency; each call autograd records
        adds 2 backward launches. Reported when the step makes at least `min-small-launches-per-step` small launches
        AND they are at least `min-small-launch-share` of those seen, at an estimated cost of
        their count times the row's launch latency.

    Why it costs:
        When each kernel takes less time than its launch, the GPU finishes it and waits for the next:
        throughput is set by the host's launch rate, not by the GPU, and a faster GPU does not help.

    Example:
        for p in model.parameters():          # hundreds of tiny elementwise kernels per step
            p.data.mul_(0.999).add_(p.grad, alpha=-lr)

    Fix:
        As the named lines show the cause: a Python loop over parameters gets `torch._foreach_*` /
        a `foreach=True` optimizer; another per-element loop gets whole-tensor ops (nn.RNN/nn.LSTM
        for a recurrence, one op over a stacked tensor); a line whose function a loop in its caller
        calls once per element (a decoder's forward per token) gets that loop named, to batch its
        elements; elementwise ops run once per call (position or rotary math) get: compute what
        depends on shapes alone once, and let `torch.compile` fuse the rest. Each offers
        `torch.compile(mode="reduce-overhead")` (CUDA graphs). A script with its own `--compile`
        option (argparse, as llm.c's train_gpt2.py has) is told to run with it instead.

    Evidence needed:
        A profiler trace with CUDA or ROCm activity (kernels and the calls that launched them), or
        a CUDA rehearsal (`audit run` of CUDA code on a machine without a GPU, or `--rehearse`).
    """

    id = "launch-bound"
    title = "The GPU waits on kernel launches"
    severity = "warning"
    needs = frozenset({"trace", "run"})
    needs_text = "needs a profiler trace with CUDA activity, or a CUDA rehearsal (`audit run` of CUDA code)"
    shares = ("gap table",)  # auditor.evidence.trace.gaps.gap_table
    options = (
        Option("min-kernels-per-step", 100,
               "Report when at least this many kernels per step run shorter than their launch."),
        Option("min-share", 0.5, "... and they are at least this share of all launched kernels."),
        Option("max-gap-us", 1000.0,
               "Launch-starved idle: gaps shorter than this (us) whose next op's launch began after the gap began."),
        Option("min-gaps-per-step", 100, "Report launch-starved idle when at least this many such gaps per step ..."),
        Option("min-starved-share", 0.2, "... and their idle is at least this share of the run's time per step."),
        Option("min-small-launches-per-step", 200,
               "CUDA rehearsal: report when the step's GPU calls launch at least this many kernels a step that "
               "would run shorter than their launch on the device model's row, their backward pass's counted as "
               "the step clock counts them ..."),
        Option("min-small-launch-share", 0.5, "... and they are at least this share of the step's launches."),
        Option("min-site-share", 0.1,
               "CUDA rehearsal: name a line when it makes at least this share of the small launches."),
    )

    def skip_reason(self, ev: m.Evidence) -> str | None:
        if ev.trace_data or ev.environment.rehearsal:
            return None
        return self.needs_text

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        # each trace's cost and text against the step the report states (a run's median step)
        for trace in ev.trace_data:
            step = step_basis_ms(ev, trace)
            found = self._judge_trace(trace, options, step)
            if found is not None:
                yield with_share(found, step)
        if ev.environment.rehearsal and ev.steps:
            found = self._rehearsed(ev, options)
            if found is not None:
                yield found

    def _rehearsed(self, ev: m.Evidence, options: Options) -> Finding | None:
        """The step's kernel launches counted in CUDA rehearsal (evidence.model.DEVICE_LAUNCH),
        each priced on the device model's row (gpu_costs.kernel_us: its bytes at the row's memory
        bandwidth, its FLOPs at the row's peak) and called small when that is under the row's
        launch latency."""
        typical = typical_pairs(ev, m.DEVICE_LAUNCH)
        pairs = typical.pairs
        if not pairs:
            return None
        device, _ = estimate_device(ev)
        n = typical.n
        launches = small = 0
        # the small launches with their backward pass's, as the step clock counts them, a step
        with_backward: dict[int, float] = {st.index: 0.0 for st in ev.steps if st.index not in typical.left_out}
        largest_small = 0.0  # bytes of the largest small launch (a class's mean)
        at: dict[tuple, dict] = defaultdict(lambda: {"launches": 0, "small": 0, "ops": Counter(), "where": None,
                                                     "callers": Counter()})
        for index, t in pairs:
            launches += t.count
            nbytes, flops = t.data.get("bytes", 0) / t.count, t.data.get("flops", 0) / t.count
            site = at[(t.where.file, t.where.line) if t.where else (None, None)]
            site["where"] = t.where
            site["launches"] += t.count
            if kernel_us(device, nbytes, flops, t.data.get("dtype", "")) < device.launch_us:
                small += t.count
                with_backward[index] = with_backward.get(index, 0.0) + t.count * backward_factor(t)
                largest_small = max(largest_small, nbytes)
                site["small"] += t.count
                site["ops"][t.what] += t.count
                caller = t.data.get("caller")
                if caller:
                    site["callers"][(caller[0], caller[1])] += t.count
        share = small / launches
        counted = float(np.median(list(with_backward.values()))) if with_backward else 0.0  # (the median step's)
        if counted < options.min_small_launches_per_step or share < options.min_small_launch_share:
            return None
        ranked = sorted((s for s in at.values() if s["small"]), key=lambda s: -s["small"])
        named = [s for s in ranked if s["small"] >= options.min_site_share * small][:5] or ranked[:1]
        named = unsuppressed(self.id, named, lambda s: s["where"])
        first = named[0]["where"].file if named[0]["where"] else None
        extra = f"{BACKWARD_FACTOR - 1:g}"
        cost = launch_cost(ev, round(counted, 2), "small kernel launches with their backward pass's",
                           f"each of these kernels moves at most {largest_small / 1e3:.0f} KB, under "
                           f"{device.launch_us:g} us at the row's {device.mem_bw_gbs:g} GB/s of memory bandwidth "
                           f"(FLOPs at its peak); the backward pass, which a rehearsal does not see, as {extra} more "
                           "launches for each call autograd records, as the step clock counts them (a GPU's "
                           "composite ops launch more)")
        message = (
            "Kernel launches would hold the GPU back: use CUDA graphs. "
            f"On an {device.name}, {per_step(small / n)} of the step's {per_step(launches / n)} kernel launches "
            f"({share:.0%}) would run shorter than their launch ({device.launch_us:g} us): each moves at most "
            f"{largest_small / 1e3:.0f} KB, under {device.launch_us:g} us at {device.mem_bw_gbs:g} GB/s, so the GPU "
            "would wait on the host's launches; most come from "
            + "; ".join(f"{', '.join(f'{op} x{per_step(k / n)}' for op, k in s['ops'].most_common(3))} per step at "
                        f"{line_ref(s['where'].file if s['where'] else None, s['where'].line if s['where'] else None, first)}"
                        for s in named)
            + f"; with the backward pass's ({extra} more for each call autograd records), about "
            f"{per_step(counted)} small launches in the median step: about {cost.ms_per_step:g} ms/step of launch time "
            "(estimated)." + typical.note(first))
        return self.finding(
            message,
            locations=[Location.of(s["where"]) for s in named if s["where"] is not None],
            evidence={"source": "rehearsal", "device": device.key, "steps": n,
                      "left_out_steps": typical.left_out_steps(),
                      "launches_per_step": round(launches / n, 2), "small_launches_per_step": round(small / n, 2),
                      "small_launches_with_backward_per_step": round(counted, 2),
                      "small_share": round(share, 4), "launch_us": device.launch_us,
                      "mem_bw_gbs": device.mem_bw_gbs,
                      "sites": [{"file": s["where"].file if s["where"] else None,
                                 "line": s["where"].line if s["where"] else None,
                                 "launches_per_step": round(s["launches"] / n, 2),
                                 "small_launches_per_step": round(s["small"] / n, 2),
                                 "ops": {op: round(k / n, 2) for op, k in s["ops"].most_common(5)},
                                 "called_from": [{"file": f, "line": ln} for (f, ln), _ in s["callers"].most_common(3)]}
                                for s in ranked[:8]]},
            cost=cost,
            fix=_fix([(s["where"].file, s["where"].line) if s["where"] else (None, None) for s in named],
                     {op for s in named for op in s["ops"]},
                     [[c for c, _ in s["callers"].most_common(3)] for s in named], ev.target,
                     ev.program.argv if ev.program else ()),
        )

    def check_trace(self, trace: Trace, options: Options) -> Finding | None:
        return self._judge_trace(trace, options, trace.median_step_ms())

    def _judge_trace(self, trace: Trace, options: Options, step_ms: float | None) -> Finding | None:
        """The trace's launch-bound finding, its launch-starved idle at most `step_ms` (the step
        the report states) less the GPU's own work per step: launches faster than the device can
        give back the idle, never the device's work."""
        steps = trace.step_count()
        short = short_kernels(trace)
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
            busy = device_busy_ms(trace) or 0.0
            window_ms = starved["ms_per_step"]
            if step_ms:
                starved["ms_per_step"] = min(window_ms, max(0.0, step_ms - busy))
                starved["share"] = starved["ms_per_step"] / step_ms
            ops = starved["ops"]
            lead = "" if short_fires else f"In {trace.label} the"
            sentences.append(
                (f"{lead} GPU waited on kernel launches {starved['ms_per_step']:.1f} ms per step "
                 if lead else f"The GPU waited on kernel launches {starved['ms_per_step']:.1f} ms per step ")
                + f"({starved['share']:.0%} of the run's time): {starved['per_step']:.0f} gaps per step, each "
                f"under {options.max_gap_us / 1000:g} ms, where the GPU ran out of work before the next op was "
                f"launched (median gap {starved['median_us']:.0f} us; {starved['host_ms']:.1f} ms per "
                f"step of host work before the launch calls, {starved['launch_ms']:.1f} ms in them); most follow "
                f"launches from {', '.join(n for n, _ in ops.most_common(3))}."
                + (f" (The profiled window held {window_ms:.1f} ms of such idle per step, more than the "
                   f"{step_ms:.2f} ms of the run's time per step less the GPU's {busy:.2f} ms of work: counted as that.)"
                   if window_ms > starved["ms_per_step"] + 0.0005 else ""))
            evidence.update({"starved_gaps": starved["gaps"], "starved_per_step": round(starved["per_step"], 1),
                             "starved_ms_per_step": round(starved["ms_per_step"], 3),
                             "starved_share": round(starved["share"], 4),
                             "window_starved_ms_per_step": round(window_ms, 3), "busy_ms_per_step": round(busy, 3),
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
            " ".join(["The GPU waits on the host's kernel launches: capture the step in CUDA graphs.", *sentences]),
            locations=[Location(*frame_location_parts(f)) for f, _, _ in where],
            evidence=evidence,
            cost=cost,
            fix=_fix([(f.file, f.line) for f, _, _ in where], evidence.get("ops", {}) | evidence.get("starved_ops", {})),
        )

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
