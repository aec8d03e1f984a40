"""host-sync: device->host synchronisations inside the step.

A run's half counts the sync calls its probes saw, per source line and step. The trace half starts
from the synchronisations a profiler trace recorded, per issuing operator: from the sync calls
themselves (not from `item()` calls), and from the copies to pageable memory that wait as a sync
does, which keeps an `aten::item` on a CPU tensor, which never waits for a GPU, out of it. It counts
the operator calls that waited, not the runtime rows they waited in: `.cpu()` of a GPU tensor
copies to pageable memory (a wait) and then syncs its stream (another) in one call.

When the trace has ProfilerSteps, only syncs inside a step count. torch.profiler synchronizes the
device itself when it stops, right after the last step (158 ms on the A100 rank-0 fixture, waiting
for the queued work of the last step): that `cudaDeviceSynchronize` is the profiler's, not the
user's. Syncs before the first step are set-up, not a per-step cost.
"""
from __future__ import annotations

import ast
import itertools
import os
from collections import Counter, defaultdict
from typing import Any, Iterable

import msgspec
import numpy as np

from auditor.evidence import model as m
from auditor.evidence.frame import Frame
from auditor.evidence.trace.gaps import gap_table, queued_during, sync_charges
from auditor.evidence.trace.intervals import merge_intervals, total_length
from auditor.evidence.trace.model import Trace
from auditor.evidence.trace.names import ASYNC_COPY_CALLS, DEVICE_SYNCS, EVENT_SYNCS, STREAM_SYNCS
from auditor.evidence.trace.queries import blocking_calls, blocking_op_calls, frame_location_parts, sites
from auditor.findings import Cost, Edit, Finding, Fix, Location, share_of_step, step_basis_ms
from auditor.fixes import call_name, edit_call_kwargs, parse_file
from auditor.rules._support.fetched_numbers import computed as computed_fetches
from auditor.rules._support.fetched_numbers import stop_tests
from auditor.rules._support.frameworks import framework_fix, settings_for
from auditor.rules._support.confidence import cost_confidence, cpu_over_wall
from auditor.rules._support.places import (by_place, locations, median_cost_of, on_accelerator, place_key,
                                           step_ms_of, typical_pairs)
from auditor.rules._support.gpu_costs import sync_cost
from auditor.rules._support.text import line_ref, per_step
from auditor.rules.base import Option, Options, Rule
from auditor.rules.suppression import unsuppressed
from auditor.rules._support.step_edits import every_n_steps

ELAPSED_TIME = "torch.cuda.Event.elapsed_time"  # the cuda-standin tally of auditor.capture.rehearsal.cuda
EVENT_TIMING = "synchronize before Event.elapsed_time"  # (an ADVICE key, not a call's name)
CLOCK_TIMING = "synchronize beside a clock read"  # (an ADVICE key, not a call's name)
RETURNED = "a host value returned"  # (an ADVICE key: `return t.item()`)
# Fetches whose values are written out: what the "every N steps" setting and patch are about.
_LOGGED = frozenset({"Tensor.item", "print/repr(Tensor)", "format(Tensor)", "Tensor.cpu", "Tensor.tolist",
                     "Tensor.numpy", "float(Tensor)", "int(Tensor)", "SummaryWriter: Tensor.cpu",
                     "SummaryWriter: Tensor.item"})
_CLOCKS = frozenset({"time", "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time_ns"})
CLOCK_LINES = 3  # a clock read this many lines or fewer from a synchronize() is taken as timing it
_DEVICE_SYNCS = ("torch.cuda.synchronize", "torch.cuda.Event.synchronize", "torch.cuda.Stream.synchronize")
_SUMMARY_WRITER = ("call SummaryWriter.add_* every N steps (each call fetches the tensor from the device), "
                   "accumulating on the device in between")
ADVICE = {
    "Tensor.item": "log every N steps, or accumulate on the device (`total += loss.detach()`) and call .item() once",
    "print/repr(Tensor)": "print every N steps, from values already fetched",
    "format(Tensor)": "format values fetched every N steps",
    "bool(Tensor)": "keep control flow on host values, or use torch.where / masking instead of `if tensor`",
    "Tensor.nonzero": "use masking or torch.where with a fixed shape; pass as_tuple/size hints where possible",
    "torch.nonzero": "use masking or torch.where with a fixed shape",
    "Tensor.masked_select": "multiply by the mask or use torch.where to keep shapes static",
    "Tensor[bool mask]": "keep shapes fixed: weight by the mask ((loss * mask).sum() / mask.sum(), or a loss's "
                         "ignore_index for labels) or use torch.where(mask, x, 0) instead of selecting with x[mask]",
    "torch.masked_select": "multiply by the mask or use torch.where to keep shapes static",
    "Tensor[bool mask] = tensor": "assign through the mask without sizing it on the host: `t.masked_scatter_(mask, "
                                  "values)` (the values in the mask's order), or compute every row and keep the "
                                  "masked ones with `torch.where(mask, new, t)`",
    "Tensor[tensor:slice]": "slice with host integers: read the device tensor of offsets once (`ix.tolist()`) or "
                            "draw it on the host, or gather the rows on the device (`torch.stack` of "
                            "`data[i:i + T]` for many `i` is `data[ix[:, None] + torch.arange(T, device=ix.device)]`)",
    "torch.cuda.synchronize": "remove explicit synchronize() calls from the step (profilers sync for you)",
    CLOCK_TIMING: "this synchronize() lets a clock read time the step: removing it would break that timing. Time "
                  "with CUDA events instead (`start.record()` ... `end.record()`) and read them every N steps "
                  "(`end.synchronize(); start.elapsed_time(end)` at logging steps only): the other steps need not "
                  "wait",
    RETURNED: "the program needs the value on the host at once, at every call (returned by the function, or an "
              "action given to an environment's step): return the tensor and fetch it where the number is needed "
              "(at logging steps only, if it is logged), or batch the calls that need it (one fetch for many "
              "environments or items); a small policy acting on one observation at a time may run faster on the CPU",
    "SummaryWriter: Tensor.cpu": _SUMMARY_WRITER,
    "SummaryWriter: Tensor.item": _SUMMARY_WRITER,
    "GradScaler.step": "create the optimizer with fused=True (Adam, AdamW, SGD): GradScaler.step then hands it "
                       "the inf check on the device instead of reading found_inf with .item() every step",
    EVENT_TIMING: "time with the events every N steps: call `end.synchronize()` and `start.elapsed_time(end)` only "
                  "at logging steps (`if i % 50 == 0`); the events keep the timestamps of their last record, so "
                  "the other steps need not wait",
    m.DISTRIBUTION_CHECK: "torch.distributions checks each distribution's arguments when it is made, and each value "
                        "given to its log_prob, and reads each check's result back to the host: once the program "
                        "is known to make valid ones, turn the checks off with "
                        "`torch.distributions.Distribution.set_default_validate_args(False)` at its start (or "
                        "`validate_args=False` where each is made); what it computes is unchanged",
    "ReduceLROnPlateau.step": "step ReduceLROnPlateau once per epoch (or per validation) on a value already "
                              "fetched: it reads the metric with float(), so a device tensor is fetched at each call",
}

# A CPU-only program (no GPU, not rehearsed) has no device to wait for: its reads are counted, and
# what it is told names no accelerator (the advice that does has a CPU wording)
CPU_ONLY_NOTE = "counted, not timed: in a CPU-only program a read of a tensor's value waits for no queued work"
CPU_ONLY_ADVICE = {
    ADVICE["Tensor.item"]: "log every N steps, or accumulate as a tensor (`total += loss.detach()`) and call .item() once",
    _SUMMARY_WRITER: "call SummaryWriter.add_* every N steps, accumulating as tensors in between",
    ADVICE[RETURNED]: "the program needs the value on the host at once, at every call (returned by the function, or "
                      "an action given to an environment's step): return the tensor and read it where the number is "
                      "needed (at logging steps only, if it is logged), or batch the calls that need it (one read for "
                      "many environments or items)",
}


_TRACE_ADVICE = {
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


def _trace_advice(op: str) -> str:
    if op in _TRACE_ADVICE:
        return _TRACE_ADVICE[op]
    if op in DEVICE_SYNCS or op in STREAM_SYNCS:
        return "Remove torch.cuda.synchronize() from the training step (keep it only around timing code)."
    if op in EVENT_SYNCS:
        return "An event wait blocks the host: use stream.wait_event() to order GPU work instead."
    return "Avoid reading GPU results on the host inside the step."


def _api(trace: Trace, row: int) -> str:
    name = trace.name(row)
    return f"{name} to pageable memory" if name in ASYNC_COPY_CALLS else name


def _one_trace(rule: Rule, trace: Trace, options: Options, step_ms: float | None) -> list[Finding]:
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
    min_syncs = int(options.trace_min_syncs)
    warn_share = options.trace_warning_share
    gaps = gap_table(trace)
    findings = []
    for op, members in groups.items():
        if len(members) < min_syncs:
            continue
        rows_of_op = [r for m in members for r in m]
        waited = np.array([total_length(merge_intervals(ts[m], end[m])) for m in members])  # us per call
        blocked_ms = float(waited.sum()) / 1000.0
        blocked_step_ms = round(blocked_ms / steps, 3)
        share = share_of_step(blocked_step_ms, step_ms)  # (the host's blocked time: not the cost, said apart)
        charges = sync_charges(trace, gaps, members)
        idle_ms = round(sum(c.idle_us for c in charges) / 1000.0 / steps, 3)
        saving_ms = round(sum(c.saving_us for c in charges) / 1000.0 / steps, 3)
        queued_ms = round(queued_during(trace, gaps, rows_of_op) / 1000.0 / steps, 3)
        apis = Counter(_api(trace, r) for r in rows_of_op)  # (runtime rows by API: a call may hold two)
        chains = Counter(" > ".join(reversed(trace.op_chain(m[0])[:4])) for m in members)
        where = sites(trace, [m[0] for m in members], weights=waited)
        n = len(members)
        times = "once" if n == 1 else f"{n} times"
        message = ("The host waits for the GPU: read values less often. "
                   f"In {trace.label}, {op} blocked the host on the GPU {times} "
                   f"({per_step(n / steps)} per step), {blocked_step_ms:.2f} ms per step"
                   + (f" ({share:.1%} of the run's time)" if share is not None else "")
                   + f" spent waiting in {', '.join(apis)}; the GPU sat idle {idle_ms:.2f} ms per step after them "
                   "until the host's next launch, and removing them saves about "
                   f"{saving_ms:.2f} ms per step on the step's critical path (per call, the smaller of the "
                   "host's wait and that idle: the host's work then overlaps the GPU's)"
                   + (f". While they waited the GPU also idled {queued_ms:.2f} ms per step with its next work "
                      "already queued: it waited on a dependency (another stream, a CUDA graph, a collective), "
                      "not on these syncs, and that idle is not theirs to recover" if queued_ms >= 0.01 else "")
                   + ".")
        findings.append(rule.finding(
            message,
            severity="warning" if share is not None and share >= warn_share else "info",  # (the host's time)
            locations=[Location(*frame_location_parts(f)) for f, _, _ in where],
            evidence={"trace": str(trace.path), "source": "trace", "op": op, "syncs": n,
                      "syncs_per_step": round(n / steps, 2), "blocked_ms": round(blocked_ms, 3),
                      "blocked_ms_per_step": round(blocked_step_ms, 3), "steps": steps,
                      "run_step_ms": round(step_ms, 3) if step_ms else None,
                      "apis": dict(apis), "op_chains": dict(chains.most_common(3)),
                      "longest_ms": round(float(waited.max()) / 1000.0, 3),
                      "gpu_idle_ms_per_step": round(idle_ms, 3), "saving_ms_per_step": saving_ms,
                      "queued_idle_ms_per_step": queued_ms,
                      "sites": [{"file": f.file, "line": f.line, "syncs": k, "ms": round(w / 1000.0, 3)}
                                for f, k, w in where]},
            # This idle time lies inside gpu-idle's idle total of the same trace: the headline's
            # recoverable sum counts it once (reports.terminal.recoverable).
            cost=Cost(ms_per_step=saving_ms, share_of_step=share_of_step(saving_ms, step_ms), measured=True,
                      note="what removing them saves on the step's critical path: per call, the smaller of the "
                           "host's wait in it and the GPU idle from it until the host's next launch (idle "
                           "with the next GPU work already queued is not theirs)",
                      within="gpu-idle"),
            fix=Fix(summary=_trace_advice(op),
                    config={"non_blocking": True} if op in ("aten::to", "aten::copy_") else {}),
        ))
    return findings


class HostSync(Rule):
    """
    What it detects:
        Calls inside the step that make the host wait for the device, counted per step with their
        line: `.item()`, `.cpu()`, `.tolist()`, `.numpy()`, `float(t)`, `int(t)`, `bool(t)` /
        `if t`, `print(t)`, `nonzero`, `masked_select`, boolean-mask indexing (`logits[mask]`,
        `v[mask] = values`), slicing by a device tensor's value (`data[i:i + T]`), `.to("cpu")`,
        `torch.cuda.synchronize()`.
        Also the syncs torch makes for the user: `GradScaler.step(opt)` (unless the optimizer is
        fused), `ReduceLROnPlateau.step(loss)`, `SummaryWriter.add_scalar(tag, tensor)`, and
        torch.distributions' argument checks (`validate_args`). A sync a library makes inside the
        user's call is counted at that call, with the function that made it (`inside`).
        On a recorded GPU trace: stream and device synchronisations and synchronous DtoH copies
        inside a ProfilerStep, each attributed to the op that issued it.

    Why it costs:
        CUDA runs asynchronously: the host queues kernels ahead of the device. A sync drains that
        queue, so the GPU idles while Python catches up. One `.item()` per step for logging can
        cost a large share of a short step.

    Example:
        bad:   losses.append(loss.item())                 # every step
        good:  if step % 50 == 0: print(loss.item())      # or accumulate on device

    Fix:
        Read values every N steps and keep accumulators on the device. A number the step computes
        with stays on the device (`value.detach()`, `R.reshape(1)`: sites with `computed_with`); a
        loop's stop test (`if loss < tol: break`) is read every N steps, or becomes a mask on the
        device (sites with `stop_test`). With a GradScaler, a fused optimizer
        (`torch.optim.AdamW(params, fused=True)`). For torch.distributions,
        `torch.distributions.Distribution.set_default_validate_args(False)`. A `synchronize()`
        before `start.elapsed_time(end)` is made rare, not removed. Where a trainer framework's
        setting makes the sync, that setting is the fix.

    Evidence needed:
        A run (probes on the sync APIs), or a profiler trace with CUDA runtime events. On a CUDA
        run the cost is the median time the syncing steps spend blocked, against the median step,
        with its confidence. On a CPU-only program the calls are counted as reads of tensor values
        on the host (info). In CUDA rehearsal (`--rehearse`), calls on tensors meant for the GPU
        are judged as GPU syncs (counted, not timed); calls on host tensors are not reported.
    """

    id = "host-sync"
    title = "The step waits for the device (host-device synchronisation)"
    severity = "warning"
    category = "performance"
    # Judged on any evidence (`needs` names no kind): only a run or a trace holds what it reads, but
    # an audit of a snapshot or a checkpoint runs it (finding nothing) rather than listing it among
    # findings.json's skipped_rules.
    shares = ("gap table",)  # auditor.evidence.trace.gaps.gap_table
    options = (
        Option("min-share-of-steps", 0.5, "Report a sync site only if it runs in at least this share of steps."),
        Option("trace-min-syncs", 1,
               "Trace: report an operator once it synchronised at least this many times in the trace."),
        Option("trace-warning-share", 0.05,
               "Trace: a finding is a warning when its syncs block this share of the step or more, else info."),
    )

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        yield from self._from_probes(ev, options)
        yield from self._outside_steps(ev)
        if ev.trace_data and not ev.steps:  # a recording; a run's own probes already saw every sync
            yield from self.trace_findings(ev, options)

    def trace_findings(self, evidence: m.Evidence, options: Options) -> list[Finding]:
        """One finding per (trace, issuing operator) for every recorded host<->GPU synchronisation."""
        out: list[Finding] = []
        for trace in evidence.trace_data:
            out.extend(_one_trace(self, trace, options, step_basis_ms(evidence, trace)))
        return out

    def _outside_steps(self, ev: m.Evidence) -> Iterable[Finding]:
        yield from _outside_steps_findings(self, ev)

    def _from_probes(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        if not ev.steps:
            return
        # the rate of a typical step: a one-off burst (a reinforcement learner's first step, which
        # holds every action its replay memory was filled with before the first update) left out
        typical = typical_pairs(ev, m.SYNC, m.one_fetch)
        n = typical.n
        real = on_accelerator(ev)
        as_gpu = real or ev.environment.rehearsal  # judged as GPU code: only syncs on device tensors
        places = [p for p in by_place(typical.pairs)
                  if len(p.steps) >= options.min_share_of_steps * n
                  and (not as_gpu or p.data.get("device") == "cuda")]
        places = unsuppressed(self.id, places, lambda p: p.where)  # out of the count, message and evidence
        if not places:
            return
        rate = sum(p.count for p in places) / n
        sites = [{"what": p.what, "file": p.where.file if p.where else None, "line": p.where.line if p.where else None,
                  "count": p.count, "per_step": round(p.count / n, 2), "steps": len(p.steps), "ms": round(p.ms, 3)}
                 for p in places]
        timed = _timed_by_events(ev, places)
        clocked = _timed_by_clock(places)
        sites = [{**s, "before_elapsed_time": timed[id(p)]} if id(p) in timed else s for s, p in zip(sites, places)]
        sites = [{**s, "clock_read_at": clocked[id(p)]} if id(p) in clocked else s for s, p in zip(sites, places)]
        # a number the line computes with is advised so even in a `return` (`return x.mm(w) +
        # b.item()` returns a tensor): only a fetch whose value itself is needed at once is returned
        computed = computed_fetches(places)
        stops = stop_tests([p for p in places if id(p) not in computed])
        returned = _returned([p for p in places if id(p) not in computed and id(p) not in stops])
        inside = {id(p): made_inside(p) for p in places}
        sites = [{**s, "inside": inside[id(p)]} if inside[id(p)] else s for s, p in zip(sites, places)]
        sites = [{**s, "computed_with": True} if id(p) in computed else s for s, p in zip(sites, places)]
        sites = [{**s, "stop_test": True} if id(p) in stops else s for s, p in zip(sites, places)]
        advice = sorted({a for p in places for a in (
            [ADVICE[EVENT_TIMING]] if id(p) in timed else [ADVICE[CLOCK_TIMING]] if id(p) in clocked else
            [ADVICE[RETURNED]] if id(p) in returned else [computed[id(p)]] if id(p) in computed else
            [stops[id(p)]] if id(p) in stops else _advice(p))})
        returned = returned | set(computed) | set(stops)  # (none is logging: no logging setting or patch for them)
        confidence, confidence_text = {}, ""
        if real:
            # measured on the device: the median blocked time of the steps that sync, against the
            # median step (like with like), and how firm it is (the spread of those steps' times)
            per_step_ms = step_ms_of(ev, (m.SYNC,), {place_key(p) for p in places})
            cost = median_cost_of(ev, per_step_ms)
            confidence, confidence_text = cost_confidence(list(per_step_ms.values()), cpu_over_wall(ev.steps),
                                                          "the syncs")
            sev, prefix = "warning", "The host waits for the GPU: read values less often. "
        elif as_gpu:
            cost = sync_cost(ev, rate)  # rehearsed: estimated from the device model
            sev, prefix = "warning", "The host would wait for the GPU: read values less often. On the GPU these synchronise: "
        else:  # a CPU-only program: nothing of accelerators is said to it
            cost = Cost(ms_per_step=None, share_of_step=None, measured=False, note=CPU_ONLY_NOTE)
            sev, prefix = "info", "Tensor values are read in the loop: read them less often. "
            advice = sorted({CPU_ONLY_ADVICE.get(a, a) for a in advice})
        fix = _fix(advice, places, returned)
        fw_config, fw_advice = framework_fix(places)
        if fw_config:  # made inside a framework: its settings are the fix, never an edit of the user's call
            config = {k: v for k, v in fix.config.items() if k != "log_every_n_steps"}
            fix = msgspec.structs.replace(fix, config={**fw_config, **config},
                                          summary="; ".join(fw_advice) + "." + (f" {fix.summary}" if fix.summary else ""))
        yield self.finding(
            f"{prefix}{per_step(rate)} {'device->host syncs' if as_gpu else 'tensor values read on the host'} "
            f"per step at {len(places)} place(s): "
            + "; ".join(f"{s['what']} x{per_step(s['count'] / n)}/step at {line_ref(s['file'], s['line'], sites[0]['file'])}"
                        + (f" (inside {' and '.join(s['inside'])})" if s.get("inside") else "")
                        + (f" (before Event.elapsed_time at line {s['before_elapsed_time']})"
                           if s.get("before_elapsed_time") else "")
                        for s in sites[:5])
            + (f"; inside the framework: {'; '.join(fw_advice)}" if fw_advice else "")
            + typical.note(sites[0]["file"])
            + (f". {confidence_text}" if confidence_text else ""),
            severity=sev, locations=locations(places),
            evidence={"syncs_per_step": round(rate, 2), "sites": sites, "measured_on_device": real,
                      "judged_as_gpu_code": as_gpu, "left_out_steps": typical.left_out_steps(), **confidence},
            cost=cost,
            fix=fix,
        )


def _innermost(vias: Iterable[str]) -> list[str]:
    """The library functions that made the calls themselves: each via's innermost entry
    ("file:qualname"), the first three in order."""
    return sorted({v.split(" < ", 1)[0] for v in vias})[:3]


def made_inside(p: Any) -> list[str]:
    """The library functions that made a place's calls themselves, when the user's line only called
    into a library (a model's forward in transformers reads a mask back to test it); [] for calls
    the user's code made."""
    return _innermost(p.vias)


def _advice(p: Any) -> list[str]:
    """A place's advice: the user's own remedies for the calls their code made; for those a library
    made inside their call with no framework setting known to skip them (framework_fix names those
    settings), that no edit of the line removes them."""
    out = [ADVICE.get(p.what, "fetch values from the device every N steps, not every step")] if p.direct else []
    unset = _innermost(v for v in p.vias if not settings_for(p.what, v))
    if unset:
        line = f" at line {p.where.line}" if p.where else ""
        out.append(f"the {p.what}{line} is made inside {' and '.join(unset)}, library code the line calls: no edit "
                   "of the line removes it; an argument or setting of that library may skip it, or a version that "
                   "keeps the check off the device")
    return out


OUTSIDE_ADVICE = ("where the values are only logged or summed, accumulate on the device and fetch once (`total += "
                  "x.sum()`, one `.item()` at the end); where the host acts on each one (an environment's next "
                  "action, an early stop), the fetch is the loop's own: fetch more per call (more environments a "
                  "step) rather than fewer calls")
PHASES = {"between": "between steps (an eval loop, a rollout, a checkpoint save)", "after": "after the last audited step"}


def _outside_steps_findings(rule: Any, ev: m.Evidence) -> Iterable[Finding]:
    """A whole program's syncs outside its steps, one finding per phase (between steps, after the
    last), at their lines: counted, not costed per step, as they are not in the step time."""
    as_gpu = on_accelerator(ev) or ev.environment.rehearsal
    for phase, phrase in PHASES.items():
        pairs = [(k, t) for k, o in enumerate(ev.outside) if o.phase == phase for t in o.tallies
                 if t.kind == m.SYNC and (not as_gpu or t.data.get("device") == "cuda")]
        places = unsuppressed(rule.id, by_place(m.one_fetch(pairs)), lambda p: p.where)
        if not places:
            continue
        first = places[0].where.file if places[0].where else None
        checks = [p for p in places if p.what == m.DISTRIBUTION_CHECK]  # (a setting turns these off)
        # under torch.no_grad() outside the steps: an evaluation loop, named so
        evaluating = [p for p in places if p.data.get("no_grad")]
        if phase == "between" and len(evaluating) == len(places):
            phrase = "between steps in an evaluation loop (under torch.no_grad())"
        yield rule.finding(
            ("Outside the steps the host waits for the GPU: fetch less often. " if as_gpu else
             "Tensor values are read outside the steps: read them less often. ")
            + f"{sum(p.count for p in places)} {'device->host syncs' if as_gpu else 'tensor values read on the host'} "
            f"{phrase}, outside the steps, at {len(places)} "
            f"place(s): " + "; ".join(f"{p.what} x{p.count} at {line_ref(p.where.file if p.where else None, p.where.line if p.where else None, first)}"
                                     + (f" (inside {' and '.join(made_inside(p))})" if p.vias else "")
                                     for p in places[:5]),
            severity="info", locations=locations(places),
            evidence={"phase": phase, "evaluation": bool(evaluating) and len(evaluating) == len(places),
                      "sites": [{"what": p.what, "file": p.where.file if p.where else None,
                                 "line": p.where.line if p.where else None, "count": p.count,
                                 "under_no_grad": bool(p.data.get("no_grad")),
                                 **({"inside": made_inside(p)} if p.vias else {})} for p in places]},
            cost=Cost(ms_per_step=None, share_of_step=None, measured=False,
                      note=f"outside the steps ({phase}): not in the step time"),
            fix=Fix(summary=OUTSIDE_ADVICE + (f"; {ADVICE[m.DISTRIBUTION_CHECK]}" if checks else ""),
                    config=_config(checks)))


def _timed_by_events(ev: m.Evidence, places: list) -> dict[int, int]:
    """{id(place): line of the elapsed_time call} for the synchronize() sites that wait so that an
    `Event.elapsed_time` after them, in the same file and step, can read the events (seen in CUDA
    rehearsal, where the events are stand-ins). Dropping that sync would make elapsed_time fail on a
    GPU (the end event not reached yet), so the advice is to time every N steps, not to remove it."""
    reads: dict[int, list[Frame]] = {}
    for step, t in ev.tallies(m.CUDA_STANDIN):
        if t.what == ELAPSED_TIME and t.where:
            reads.setdefault(step, []).append(t.where)
    out: dict[int, int] = {}
    for p in places:
        if p.what not in _DEVICE_SYNCS or not p.where:
            continue
        after = [[w.line for w in reads.get(s, []) if w.file == p.where.file and w.line > p.where.line]
                 for s in p.steps]
        if sum(bool(a) for a in after) >= 0.5 * len(p.steps):
            out[id(p)] = min(line for a in after for line in a)
    return out


def _timed_by_clock(places: list) -> dict[int, int]:
    """{id(place): line of the clock read} for the synchronize() sites with a clock read
    (`time.time()`, `time.perf_counter()`, ...) within CLOCK_LINES lines of them in the same file:
    the sync makes that clock time the device's work, so removing it would break the program's own
    timing (what rehearsal's event stand-ins show for elapsed_time, read from the source here)."""
    out: dict[int, int] = {}
    for p in places:
        if p.what not in _DEVICE_SYNCS or not p.where:
            continue
        parsed = parse_file(p.where.file)
        if parsed is None:
            continue
        near = sorted((abs(n.lineno - p.where.line), n.lineno) for n in ast.walk(parsed[0])
                      if isinstance(n, ast.Call) and call_name(n) in _CLOCKS
                      and 0 < abs(n.lineno - p.where.line) <= CLOCK_LINES)
        if near:
            out[id(p)] = near[0][1]
    return out


ACTED_ON_LINES = 10  # an assigned fetch given to an environment's `.step(...)` this many lines on at most


def _returned(places: list) -> set[int]:
    """{id(place)} of the fetches the program needs at once, so that logging less often is not
    their fix: those a `return` statement makes (`return action.item()`), and actions given to an
    environment's step (`envs.step(action.cpu().numpy())`, or `actions = ....cpu().numpy()` and
    `envs.step(actions)` on a line after it: CleanRL's PPO and DQN)."""
    out = set()
    for p in places:
        if p.what not in _LOGGED or not p.where:
            continue
        parsed = parse_file(p.where.file)
        if parsed is None:
            continue
        line = p.where.line
        stmts = [n for n in ast.walk(parsed[0]) if isinstance(n, ast.stmt) and not hasattr(n, "body")
                 and n.lineno <= line <= (n.end_lineno or n.lineno)]
        if any(isinstance(n, ast.Return) for n in stmts) or any(_acted_on(n, parsed[0]) for n in stmts):
            out.add(id(p))
    return out


def _steps_with(node: ast.AST, names: set[str] | None = None) -> bool:
    """A `.step(...)` call in `node` that is no optimizer's or scheduler's (`envs.step(a)`), given
    one of `names` (None: any argument) as an argument."""
    for c in ast.walk(node):
        if not (isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "step" and c.args):
            continue
        owner = ast.unparse(c.func.value).lower()
        if any(w in owner for w in ("opt", "sched", "scaler", "lr")):
            continue
        if names is None or any(isinstance(a, ast.Name) and a.id in names for a in c.args):
            return True
    return False


def _acted_on(stmt: ast.stmt, tree: ast.Module) -> bool:
    """The fetch's statement gives its value to an environment's step, itself or by the name it
    assigns (on a line at most ACTED_ON_LINES on)."""
    if _steps_with(stmt):
        return True
    if not isinstance(stmt, ast.Assign):
        return False
    names = {t.id for target in stmt.targets for t in ast.walk(target) if isinstance(t, ast.Name)}
    end = stmt.end_lineno or stmt.lineno
    return any(isinstance(n, ast.stmt) and not hasattr(n, "body") and end < n.lineno <= end + ACTED_ON_LINES
               and _steps_with(n, names) for n in ast.walk(tree))


LOG_EVERY = 50  # the steps between two fetches the logging patch and setting propose


def _fix(advice: list[str], places: list, returned: set[int] = frozenset()) -> Fix:  # type: ignore[assignment]
    """The advice, with its patches: fused=True on the optimizer a GradScaler.step site steps,
    where its constructor is found (a fused optimizer rounds slightly differently from the foreach
    one, so that edit changes results, and the logging is then advice); else the logging statements that fetch every step guarded to run every
    LOG_EVERY steps (rules._support.step_edits), when every site is one in a loop that counts steps."""
    fused = [e for p in places if p.what == "GradScaler.step" and p.where
             for e in [_fused_edit(p.where.file, p.where.line)] if e]
    edits = [e for e, _ in fused]
    summary = "; ".join(advice) + "." if advice else ""
    if edits:
        summary += (" fixes.patch adds fused=True to the optimizer at line "
                    + ", ".join(str(line) for _, line in fused)
                    + " (it changes results: the fused kernels round slightly differently).")
        return Fix(summary=summary, config=_config(places, returned), edits=edits, changes_numerics=True)
    # Only when every site is guarded: the finding is the step's syncs together, and a patch that
    # leaves one of them syncing every step leaves the finding (--verify: no-change).
    logged = []
    for p in places:
        # (a sync a library makes inside the line is no logging of the line's own to thin out)
        e = every_n_steps(p.where.file, p.where.line, LOG_EVERY) if p.what in _LOGGED and p.where and p.direct else None
        if e is None:
            logged = []
            break
        if e not in logged:
            logged.append(e)
    if logged:
        summary += (" fixes.patch prints/logs every " + str(LOG_EVERY) + " steps at line "
                    + ", ".join(str(e.start) for e in logged) + " (guarded by the loop's step counter).")
    checks = _checks_off([p for p in places if p.what == m.DISTRIBUTION_CHECK])
    if checks is not None:
        summary += (f" fixes.patch turns torch.distributions' argument checks off after the imports at the head "
                    f"of {os.path.basename(checks.file)} (line {checks.end}).")
    return Fix(summary=summary, config=_config(places, returned), edits=logged + ([checks] if checks else []))


CHECKS_OFF = "torch.distributions.Distribution.set_default_validate_args(False)"


def _checks_off(places: list) -> Edit | None:
    """The line that turns torch.distributions' argument checks off, inserted after the imports at
    the head of the file where the first checked distribution is made, `import torch` among them
    (before any is made: the module's head runs first); None where there is no such import or the
    file sets it already."""
    where = next((p.where for p in places if p.where), None)
    parsed = parse_file(where.file) if where else None
    if parsed is None or CHECKS_OFF.split("(")[0] in "\n".join(parsed[1]):
        return None
    body = parsed[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # (the module's docstring)
    # (after the imports at the file's head, where `import torch` is one of them)
    head = list(itertools.takewhile(lambda n: isinstance(n, (ast.Import, ast.ImportFrom)), body))
    if not any(isinstance(n, ast.Import) and any(a.name == "torch" and a.asname is None for a in n.names)
               for n in head):
        return None
    after = head[-1].end_lineno or head[-1].lineno
    return Edit(file=where.file, start=after + 1, end=after, lines=[f"{CHECKS_OFF}  # auditor: host-sync"])


_FUSABLE = ("Adam", "AdamW", "SGD")


def _fused_edit(file: str, line: int) -> tuple[Edit, int] | None:
    """fused=True (and the constructor's line) on the constructor of the optimizer `scaler.step(opt)` on `line` steps: `opt` a
    name assigned once in the file from `torch.optim.Adam/AdamW/SGD(...)` that sets neither fused,
    foreach (fused and foreach=True refuse each other) nor differentiable (which fused refuses)."""
    parsed = parse_file(file)
    if parsed is None:
        return None
    tree, _ = parsed
    steps = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "step" and n.lineno <= line <= (n.end_lineno or n.lineno)
             and n.args and isinstance(n.args[0], ast.Name)]
    if len(steps) != 1:
        return None
    name = steps[0].args[0].id  # type: ignore[attr-defined]
    made = [n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)]
    if len(made) != 1 or not isinstance(call := made[0], ast.Call):
        return None
    kind = call_name(call)
    if kind not in _FUSABLE or any(k.arg in ("fused", "foreach", "differentiable", None) for k in call.keywords):
        return None
    edit = edit_call_kwargs(file, call.lineno, (kind,), {"fused": "True"})
    return (edit, call.lineno) if edit else None


def _config(places: list, returned: set[int] = frozenset()) -> dict[str, Any]:  # type: ignore[assignment]
    config: dict[str, Any] = {}
    # a setting of the logging: only where values are fetched to be logged (not returned to a caller)
    if any(p.what in _LOGGED and id(p) not in returned for p in places):
        config["log_every_n_steps"] = LOG_EVERY
    if any(p.what == "GradScaler.step" for p in places):
        config["optimizer"] = {"fused": True}
    if any(p.what == m.DISTRIBUTION_CHECK for p in places):
        config["torch.distributions.Distribution.set_default_validate_args"] = False
    return config
