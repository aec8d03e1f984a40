"""Two loaded Evidence side by side (`audit diff A B`, `audit run --baseline DIR`): the numbers of
each side per step, and what changed between them by how much, each change beside its noise.

Each side is summarised from what it recorded (`summarize`): a run from its steps and probes (and
its profiled window's trace for operators and kernels), a recording from its trace's ProfilerSteps.
A number is a per-step `Stat`: the median over the steps, and the spread of the per-step values
(half their interquartile range). A change is "within noise" when it is no larger than the two
sides' spreads added in quadrature (and at least RESOLUTION of the larger value): the steps of
one side alone already differ by that much.
Lower is better for every number here (time, syncs, copies, bytes, memory).

The run's time per step (auditor.evidence.run_time: the span over the steps, stalls and the time
between steps in it) and its parts are means, not medians: each a `Mean` whose noise is how much
its typical step differs from the others (the median absolute deviation of its per-step values:
stalls that hit some steps are time the run spent, not noise). It is what a comparison judges
(`judged`) where both sides have it; the median step where either has none (a recording without
steps).

Findings are compared by the pipeline that runs the rules (auditor.diff); their changes are
carried here as `FindingChange`, plain data the reports render. Nothing here imports torch.
"""
from __future__ import annotations

import math
import re
import statistics
from typing import Any

import msgspec
import numpy as np

from auditor.evidence import model as m
from auditor.evidence.phases import step_phases
from auditor.evidence.trace.decode import CAT, GPU_WORK
from auditor.evidence.trace.intervals import clip, merge_intervals, total_length
from auditor.evidence.trace.queries import DATALOADER_NEXT, blocking_calls, blocking_op_calls
from auditor.evidence.trace.steps import OPTIMIZER_STEP

TOP_OPS = 8  # operators (and kernel groups) per side shown: the costliest of either side
BACKWARD = re.compile(r"^autograd::engine::evaluate_function: ")
# The least noise a number has: steps that repeat to the microsecond (a recorded trace's kernels)
# still differ by this share from one recording to the next, and a 0.1% change is no change.
RESOLUTION = 0.01
WITHIN_NOISE, BETTER, WORSE, NEW, GONE, SAME = "within noise", "better", "worse", "new", "gone", "same"
RUN_TIME, MEDIAN_STEP = "run's time per step", "median step"  # the rows a comparison is judged by
# The run's time's parts, as the comparison names them (auditor.evidence.run_time.PARTS, less the
# audit's own work, which the run's time per step leaves out)
RUN_PARTS = {"work": "work", "data": "data waits", "between": "between steps", "syncs": "syncs", "rest": "rest"}


class Stat(msgspec.Struct):
    """A per-step number of one side: `median` over its steps, `spread` (half the interquartile
    range of the per-step values: the noise of one side), `n` the steps it is taken over."""

    median: float
    spread: float = 0.0
    n: int = 0


class Mean(msgspec.Struct):
    """A per-step number of one side that is a mean over its steps: `value` (the run's time per
    step, or one of its parts), `noise` (the median absolute deviation of the per-step values: as
    much as a typical step differs from the others; steps that stall, fewer than half of them, are
    not noise), `n` the steps the noise is taken over."""

    value: float
    noise: float = 0.0
    n: int = 0


class Side(msgspec.Struct):
    """What one input measured. kind: "run" (an `audit run` directory) or "trace" (profiler traces
    or a TensorBoard logdir); label: the path as given; steps: steps measured (a run's unprofiled
    steps, a trace's ProfilerSteps); step_ms: wall time per step. phases, ops, kernels: ms per step
    by name (phases: data/forward/backward/optimizer/sync/cleanup/other from a run's probes;
    data/backward/optimizer/gpu busy from a trace; ops: CPU operators' self time and kernels: GPU
    kernels grouped by name, from the trace). syncs: device->host synchronisations per step;
    copies / copy_bytes: host<->device copies per step and their bytes; memory: per-step peaks in
    bytes by what was measured (None: not recorded). run_ms: the run's time per step (RunTime.base_ms,
    None: no account: a recording without steps), over `run_steps` steps; run_parts: its parts that
    add up to it (work, data, between, syncs, rest) by name, ms per step."""

    label: str
    kind: str
    steps: int = 0
    step_ms: Stat | None = None
    phases: dict[str, Stat] = {}
    ops: dict[str, Stat] = {}
    kernels: dict[str, Stat] = {}
    syncs: Stat | None = None
    copies: Stat | None = None
    copy_bytes: Stat | None = None
    memory: dict[str, Stat] = {}
    device: str = ""
    notes: list[str] = []
    run_ms: Mean | None = None
    run_steps: int = 0
    run_parts: dict[str, Mean] = {}


class Delta(msgspec.Struct):
    """One number of both sides. group: run | step | phase | op | kernel | syncs | copies | memory;
    unit: ms | count | bytes; a, b: the medians, or the run's time's means (group run) (None: that
    side did not record it); change: b - a;
    pct: change over a, in percent (None when a is 0 or absent); noise: the sides' spreads in
    quadrature, at least RESOLUTION of the larger median; verdict: better | worse | within noise | same (both 0) | new | gone."""

    group: str
    name: str
    unit: str
    a: float | None
    b: float | None
    change: float | None = None
    pct: float | None = None
    noise: float | None = None
    verdict: str = WITHIN_NOISE


class FindingChange(msgspec.Struct):
    """A finding of either side. status: gone (only in A) | new (only in B) | kept (in both);
    where: its first place (file name:line); cost_a / cost_b: its ms per step on each side (None:
    absent or counted only); verdict: as a Delta's, judged against the step's noise."""

    rule: str
    severity: str
    title: str
    status: str
    where: str = ""
    cost_a: float | None = None
    cost_b: float | None = None
    change: float | None = None
    verdict: str = ""
    message_a: str = ""
    message_b: str = ""


class Comparison(msgspec.Struct):
    """A against B: both sides, every compared number (deltas, in the order groups are shown), the
    findings' changes, step_pct: how much slower (+) or faster (-) B's median step is, in %;
    run_pct: the same of the run's time per step (None: a side has none); judged_by: what the
    comparison is judged by (RUN_TIME where both sides have it, else MEDIAN_STEP)."""

    a: Side
    b: Side
    deltas: list[Delta] = []
    findings: list[FindingChange] = []
    step_pct: float | None = None
    run_pct: float | None = None
    judged_by: str = "median step"


# --- one side -------------------------------------------------------------------------------------

def stat(values: list[float]) -> Stat | None:
    """Median and spread (half the interquartile range) of per-step values; None for none."""
    vals = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None
    if len(vals) >= 2:
        q1, _, q3 = statistics.quantiles(vals, n=4, method="inclusive")
        spread = (q3 - q1) / 2
    else:
        spread = 0.0
    return Stat(median=statistics.median(vals), spread=spread, n=len(vals))


def summarize(evidence: m.Evidence, label: str) -> Side:
    """One side's numbers (see Side)."""
    side = Side(label=label, kind="run" if evidence.source == "run" else "trace", device=evidence.environment.device)
    trace = _main_trace(evidence)
    if evidence.source == "run" and evidence.steps:
        _from_run(evidence, side)
    elif trace is not None:
        per_step = ([float(d) / 1000.0 for d in trace.steps["dur"]] if len(trace.steps) else [trace.step_ms()])
        side.steps, side.step_ms = len(trace.steps), stat(per_step)
        side.phases = _trace_phases(trace)
        side.syncs = _trace_syncs(trace)
        side.copies, side.copy_bytes = _trace_copies(trace)
        side.memory = _trace_memory(trace)
    if trace is not None:
        side.ops, side.kernels = _trace_ops(trace)
        if side.kind == "run":
            side.notes.append(f"operators and kernels from the run's profiled steps ({trace.label})")
    _run_time(evidence, side)
    return side


def _run_time(evidence: m.Evidence, side: Side) -> None:
    """The side's run's time per step and its parts, each with the deviation of its per-step
    values (auditor.evidence.run_time.per_step); nothing without an account."""
    from auditor.evidence.run_time import per_step, run_time

    account = run_time(evidence)
    values = per_step(evidence) if account is not None else None
    if account is None or values is None:
        return
    side.run_steps = account.steps
    side.run_ms = Mean(account.base_ms, _deviation(values["run"]), len(values["run"]))
    for part in account.parts:
        if part.name in RUN_PARTS:
            got = values.get(part.name) or []
            side.run_parts[part.name] = Mean(part.per_step_ms, _deviation(got), len(got))


def _deviation(values: list[float]) -> float:
    """The median absolute deviation of per-step values (0 for fewer than two)."""
    vals = [v for v in values if math.isfinite(v)]
    if len(vals) < 2:
        return 0.0
    mid = statistics.median(vals)
    return statistics.median(abs(v - mid) for v in vals)


def _main_trace(evidence: m.Evidence) -> Any | None:
    """The trace a side's per-step numbers come from: a run's profiled window (its first trace),
    a recording's trace whose steps the reports show."""
    traces = evidence.trace_data
    if not traces:
        return None
    return evidence.shown_trace() or traces[0]


def _from_run(evidence: m.Evidence, side: Side) -> None:
    steps = [s for s in evidence.steps if not s.failed and not s.profiled] or \
            [s for s in evidence.steps if not s.failed]
    side.steps, side.step_ms = len(steps), stat([s.ms for s in steps])
    per_phase = [step_phases(s) for s in steps]
    for name in per_phase[0] if per_phase else ():
        values = [p[name] for p in per_phase]
        if any(values):
            side.phases[name] = stat(values)
    side.syncs = stat([sum(t.count for t in s.tallies if t.kind == m.SYNC) for s in steps])
    copies = [[t for t in s.tallies if t.kind == m.H2D_COPY] for s in steps]
    if any(copies):  # recorded in CUDA rehearsal; a GPU run's copies are in its trace
        side.copies = stat([sum(t.count for t in c) for c in copies])
        side.copy_bytes = stat([sum(t.count * int(t.data.get("bytes") or 0) for t in c) for c in copies])
    else:
        trace = _main_trace(evidence)
        if trace is not None:
            side.copies, side.copy_bytes = _trace_copies(trace)
    for key, field in (("host RSS at step end", "rss_bytes"), ("device allocated at step end", "device_allocated"),
                       ("device reserved at step end", "device_reserved")):
        values = [getattr(s, field) for s in steps if getattr(s, field) is not None]
        if values:
            side.memory[key] = stat(values)
    trace = _main_trace(evidence)
    if trace is not None:  # the allocator's peaks within the profiled steps, when recorded
        side.memory.update(_trace_memory(trace))


def _step_windows(trace: Any) -> list[tuple[int, float, float]]:
    steps = trace.steps
    if len(steps):
        return [(int(s.step), float(s.ts), float(s.end)) for s in steps.itertuples()]
    return [(-1, *trace.window())]


def _per_step_ms(trace: Any, iv: tuple[np.ndarray, np.ndarray]) -> list[float]:
    return [total_length(clip(iv, lo, hi)) / 1000.0 for _, lo, hi in _step_windows(trace)]


def _trace_phases(trace: Any) -> dict[str, Stat]:
    """Per step: time inside DataLoader __next__, autograd's backward functions, Optimizer.step,
    and the GPU's busy time (any kernel, copy or memset), each a union of intervals."""
    ev = trace.events
    host = ev[ev["cat"].isin((CAT["cpu_op"], CAT["annotation"])) & ~ev["instant"]]
    out: dict[str, Stat] = {}
    for name, rows in (("data", trace.matching(DATALOADER_NEXT, host)), ("backward", trace.matching(BACKWARD, host)),
                       ("optimizer", trace.matching(OPTIMIZER_STEP, host)), ("gpu busy", ev[ev["cat"].isin(GPU_WORK)])):
        if len(rows):
            out[name] = stat(_per_step_ms(trace, merge_intervals(rows["ts"].to_numpy(), rows["end"].to_numpy())))
    return out


def _trace_syncs(trace: Any) -> Stat | None:
    """Calls that blocked the host on the GPU per step (one per operator call, as host-sync counts)."""
    if not len(trace.of("kernel", "memcpy")):
        return None  # a CPU-only trace: nothing to wait for
    rows = blocking_calls(trace)
    calls = blocking_op_calls(trace, rows) if len(rows) else np.empty(0, dtype=np.int64)
    step = trace.col("step")
    counts = []
    for number, _, _ in _step_windows(trace):
        counts.append(len(set(calls[step[rows] == number].tolist())) if len(rows) else 0)
    return stat(counts)


def _trace_copies(trace: Any) -> tuple[Stat | None, Stat | None]:
    """GPU copy records (Memcpy HtoD/DtoH/DtoD) per step: how many, and their bytes."""
    rows = trace.of("memcpy")
    if not len(trace.of("kernel", "memcpy")):
        return None, None
    step = rows["step"].to_numpy()
    nbytes = np.clip(rows["bytes"].to_numpy(), 0, None)
    numbers = [n for n, _, _ in _step_windows(trace)]
    return (stat([int((step == n).sum()) for n in numbers]),
            stat([float(nbytes[step == n].sum()) for n in numbers]))


def _trace_memory(trace: Any) -> dict[str, Stat]:
    """The allocator's total allocated at its highest in each step (`[memory]` events: profiled
    with profile_memory=True), per device kind."""
    mem = trace.named("[memory]")
    out: dict[str, Stat] = {}
    if not len(mem):
        return out
    step, total, kind = mem["step"].to_numpy(), mem["total_allocated"].to_numpy(), mem["device_type"].to_numpy()
    for label, sel in (("GPU allocated peak", kind > 0), ("CPU allocated peak", kind == 0)):
        peaks = [float(total[sel & (step == n)].max()) for n, _, _ in _step_windows(trace)
                 if (sel & (step == n)).any()]
        if peaks and max(peaks) > 0:
            out[label] = stat(peaks)
    return out


def kernel_group(name: str) -> str:
    """A kernel's name without its template and parameter lists (`void at::native::foo<float, 4>(...)`
    -> `at::native::foo`): the instantiations of one kernel are one line."""
    short = name[5:] if name.startswith("void ") else name
    cut = min([i for i in (short.find("<"), short.find("(")) if i > 0] or [len(short)])
    return short[:cut].strip() or name


def _trace_ops(trace: Any) -> tuple[dict[str, Stat], dict[str, Stat]]:
    """Per step: CPU operators' self time (their time less the operators and runtime calls nested
    in them, as the profiler's table has it; the auditor's own ranges left out), and GPU kernels'
    time grouped by kernel_group."""
    cat, dur, parent, name, step = (trace.col(c) for c in ("cat", "dur", "parent", "name", "step"))
    instant = trace.col("instant")
    mine = trace.auditor_rows() if len(trace.auditor_ranges()) else np.zeros(len(cat), dtype=bool)
    timed = np.flatnonzero(np.isin(cat, (CAT["cpu_op"], CAT["runtime"], CAT["driver"])) & ~mine & (parent >= 0))
    inner = np.bincount(parent[timed], weights=dur[timed], minlength=len(cat))
    windows = [n for n, _, _ in _step_windows(trace)]
    in_step = np.isin(step, windows) if windows != [-1] else np.ones(len(cat), dtype=bool)
    ops = np.flatnonzero((cat == CAT["cpu_op"]) & ~instant & ~mine & in_step)
    kernels = np.flatnonzero((cat == CAT["kernel"]) & in_step)
    return (_by_name(trace, ops, np.maximum(dur[ops] - inner[ops], 0.0), step, windows, lambda s: s),
            _by_name(trace, kernels, dur[kernels], step, windows, kernel_group))


def _by_name(trace: Any, rows: np.ndarray, us: np.ndarray, step: np.ndarray, windows: list[int],
             key: Any) -> dict[str, Stat]:
    """ms per step of `rows` grouped by `key(name)`: every group (a side's name missing from the
    other is then truly absent there, not cut off), the costliest first."""
    if not len(rows):
        return {}
    codes, which = np.unique(trace.col("name")[rows], return_inverse=True)
    groups = list(dict.fromkeys(key(trace.symbols[int(c)]) for c in codes.tolist()))
    index = {name: i for i, name in enumerate(groups)}
    g = np.array([index[key(trace.symbols[int(c)])] for c in codes.tolist()], dtype=np.int64)[which]
    if windows == [-1]:
        slot = np.zeros(len(rows), dtype=np.int64)
    else:
        slot = np.searchsorted(np.sort(np.array(windows)), step[rows])  # (every row is in a window: in_step)
    n = max(1, len(windows))
    sums = np.bincount(g * n + slot, weights=us, minlength=len(groups) * n).reshape(len(groups), n) / 1000.0
    order = np.argsort(-sums.sum(axis=1), kind="stable")
    return {groups[i]: stat(sums[i].tolist()) for i in order.tolist()}


# --- two sides ------------------------------------------------------------------------------------

def delta(group: str, name: str, unit: str, a: Stat | Mean | None, b: Stat | Mean | None,
          floor: float = 0.0) -> Delta:
    """B against A for one number (see Delta): a Stat's median, a Mean's value, each with its noise
    (at least `floor`)."""
    va, vb = _value(a), _value(b)
    if va is None and vb is None:
        return Delta(group, name, unit, None, None, verdict=SAME)
    if va is None or vb is None:
        return Delta(group, name, unit, va, vb, verdict=NEW if va is None else GONE)
    change = vb - va
    noise = max(math.hypot(_noise(a), _noise(b)), RESOLUTION * max(abs(va), abs(vb)), floor)
    pct = change / va * 100.0 if va else None
    if va == 0 and vb == 0:
        verdict = SAME
    elif abs(change) <= noise:
        verdict = WITHIN_NOISE
    else:
        verdict = BETTER if change < 0 else WORSE
    return Delta(group, name, unit, va, vb, change, pct, noise, verdict)


def _value(x: Stat | Mean | None) -> float | None:
    return None if x is None else x.value if isinstance(x, Mean) else x.median


def _noise(x: Stat | Mean | None) -> float:
    return 0.0 if x is None else x.noise if isinstance(x, Mean) else x.spread


def compare(a: Side, b: Side) -> Comparison:
    """Every number either side recorded, B against A (see Comparison): the run's time per step
    and its parts first (where either side has them), then the median step and the rest."""
    out: list[Delta] = []
    if a.run_ms is not None or b.run_ms is not None:
        out.append(delta("run", RUN_TIME, "ms", a.run_ms, b.run_ms))
        # (a part's resolution is the whole's: a change under 1% of the run's time is none)
        floor = RESOLUTION * max(_value(a.run_ms) or 0.0, _value(b.run_ms) or 0.0)
        for name, words in RUN_PARTS.items():
            pa, pb = a.run_parts.get(name), b.run_parts.get(name)
            if _value(pa) or _value(pb):
                out.append(delta("run", words, "ms", pa, pb, floor))
    out.append(delta("step", MEDIAN_STEP, "ms", a.step_ms, b.step_ms))
    for group, da, db in (("phase", a.phases, b.phases),):
        for name in list(dict.fromkeys([*da, *db])):
            out.append(delta(group, name, "ms", da.get(name), db.get(name)))
    if a.syncs is not None or b.syncs is not None:
        out.append(delta("syncs", "syncs per step", "count", a.syncs, b.syncs))
    if a.copies is not None or b.copies is not None:
        out.append(delta("copies", "copies per step", "count", a.copies, b.copies))
        out.append(delta("copies", "bytes copied per step", "bytes", a.copy_bytes, b.copy_bytes))
    for name in dict.fromkeys([*a.memory, *b.memory]):
        out.append(delta("memory", name, "bytes", a.memory.get(name), b.memory.get(name)))
    for group, da, db in (("op", a.ops, b.ops), ("kernel", a.kernels, b.kernels)):
        names = sorted(set(da) | set(db), key=lambda n: -max(da[n].median if n in da else 0.0,
                                                            db[n].median if n in db else 0.0))[:TOP_OPS]
        out.extend(delta(group, n, "ms", da.get(n), db.get(n)) for n in names)
    median = next(d for d in out if d.name == MEDIAN_STEP and d.group == "step")
    run = next((d for d in out if d.name == RUN_TIME and d.group == "run"), None)
    both = a.run_ms is not None and b.run_ms is not None
    return Comparison(a=a, b=b, deltas=out, step_pct=median.pct, run_pct=run.pct if run is not None else None,
                      judged_by=RUN_TIME if both else MEDIAN_STEP)


def judged(c: Comparison) -> Delta | None:
    """The row the comparison is judged by (Comparison.judged_by): the run's time per step where
    both sides have it, else the median step."""
    group = "run" if c.judged_by == RUN_TIME else "step"
    return next((d for d in c.deltas if d.group == group and d.name == c.judged_by), None)


def median_delta(c: Comparison) -> Delta | None:
    """The median step's row."""
    return next((d for d in c.deltas if d.group == "step" and d.name == MEDIAN_STEP), None)


def step_noise(c: Comparison) -> float:
    """The judged row's noise (auditor.evidence.compare.judged: findings' costs are shares of the
    run's time), 0 when either side is unknown."""
    d = judged(c)
    return (d.noise or 0.0) if d is not None else 0.0
