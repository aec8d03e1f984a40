"""The run's time: one account of the steady span, from the first audited step's start to the last
one's end, split into parts a user can act on. The parts add up to the span.

* work: the steps' own work (their time less the parts below inside them);
* data: the steps' waits for their batches, stalls included;
* between: the stretches between steps, split by what the probes timed there (`what`);
* syncs: the steps' device->host syncs;
* rest: what no record covers;
* audit: the audit's own work: the checked and profiled steps' time over the timed steps' (medians
  times their number), taken out of those steps' work (past it, their data waits), and the
  audit's work at step boundaries.

`base_ms` is the span less the audit's part, over the steps: the program's time a step without
the audit, and what every finding's cost is a share of (auditor.findings.step_basis_ms). A
recording's account is its steps, each on its bound's clock, and the time between them.
"""
from __future__ import annotations

import os
import statistics
from typing import TYPE_CHECKING, Any

import msgspec

from auditor.evidence import model as m

if TYPE_CHECKING:
    from auditor.evidence.trace.model import Trace

# A run with fewer timed steps than this says so, with the --steps that gives enough: ASK_STEPS
# (capture.numerics.schedule.SHORT_RUN) keeps ASK_GIVES of them timed (TIMED_AT_LEAST)
ENOUGH_TIMED = 8
ASK_STEPS = 30
ASK_GIVES = 15
SLOWEST = 3  # the slowest steps named beside the median

PARTS = ("work", "data", "between", "syncs", "rest", "audit")


class Piece(msgspec.Struct):
    """Some of a part: `name` in words, its `ms` over the span and per step."""

    name: str
    ms: float
    per_step_ms: float


class Part(msgspec.Struct):
    """One part of the run's time (PARTS): `ms` over the span, `per_step_ms` (over the steps),
    `share` of the run's time per step (`RunTime.base_ms`; the audit's part over it too, as extra),
    and `what` it holds, where known (between: epoch starts, evaluation, checkpoints, syncs, other;
    audit: checked steps, profiled steps, step boundaries)."""

    name: str
    ms: float
    per_step_ms: float
    share: float
    what: list[Piece] = []


class SlowStep(msgspec.Struct):
    """One of the slowest steps: its index, time (host's clock; a recording's on its bound's),
    `role` (timed, checked, profiled, failed; "" for a recording's) and what it waited on
    (`waited`: {"data": ms, "syncs": ms}, those over 0)."""

    step: int
    ms: float
    role: str = ""
    waited: dict[str, float] = {}


class RunTime(msgspec.Struct):
    """The account (see the module doc). `per_step_ms`: the span over the steps, the audit in it;
    `base_ms`: without the audit's part. `median_ms`, `p10_ms`, `p90_ms`: the steps the median is
    of (Evidence.median_basis, a recording's steps), each on its bound's clock. `floor_ms`: the
    device's own work per step, where known: what no fix removes. `timed_steps` and `ask_steps`: a
    run with fewer than ENOUGH_TIMED timed steps, and the --steps to ask for (None: none to ask).
    `trace`: the recording's label. `note`: what is not measured (the checks' cost with no step
    run without them)."""

    source: str
    steps: int
    span_ms: float
    per_step_ms: float
    base_ms: float
    parts: list[Part]
    median_ms: float | None = None
    p10_ms: float | None = None
    p90_ms: float | None = None
    slowest: list[SlowStep] = []
    floor_ms: float | None = None
    timed_steps: int | None = None
    ask_steps: int | None = None
    trace: str | None = None
    note: str = ""

    def part(self, name: str) -> Part:
        return next(p for p in self.parts if p.name == name)

    @property
    def too_few(self) -> bool:
        return self.timed_steps is not None and self.timed_steps < ENOUGH_TIMED


def run_time(ev: m.Evidence) -> RunTime | None:
    """The account of a run's steps, else of the recording whose steps the reports show; None
    without steps. Made once per evidence."""
    if "_run_time" not in ev.__dict__:
        trace = ev.shown_trace()
        ev.__dict__["_run_time"] = (_of_run(ev) if ev.steps else of_trace(trace) if trace is not None else None)
    return ev.__dict__["_run_time"]


def _r(x: float) -> float:
    return round(x, 3)


def _waits(s: m.StepRecord) -> tuple[float, float]:
    """(data, syncs) a step waited, in ms, together at most its time."""
    data = sum(t.ms for t in s.tallies if t.kind in (m.DATA_WAIT, m.DATA_ITER))
    syncs = sum(t.ms for _, t in m.one_fetch([(0, t) for t in s.tallies]) if t.kind == m.SYNC)
    data = min(data, s.ms)
    return data, min(syncs, s.ms - data)


def _role(s: m.StepRecord) -> str:
    return "failed" if s.failed else "profiled" if s.profiled else "checked" if s.numerics is not None else "timed"


def _of_run(ev: m.Evidence) -> RunTime | None:
    steps = sorted(ev.steps, key=lambda s: s.start_s)
    if not steps:
        return None
    n = len(steps)
    first, last = steps[0], steps[-1]
    span = (last.start_s - first.start_s) * 1e3 + last.ms
    waits = {s.index: _waits(s) for s in steps}
    work = {s.index: s.ms - sum(waits[s.index]) for s in steps}
    data = sum(d for d, _ in waits.values())
    syncs = sum(w for _, w in waits.values())
    between = _between(ev, first.index, last.index)
    between_ms = sum(p.ms for p in between)
    boundaries = sum(s.own_before_ms or 0.0 for s in steps[1:])
    rest = max(0.0, span - sum(s.ms for s in steps) - between_ms - boundaries)
    if n > 1 and all(s.own_before_ms is None for s in steps):
        # (evidence recorded before the boundaries were timed: what no record covers between
        # contiguous steps is the audit's work there, its records, profiler and graph scans)
        boundaries, rest = rest, 0.0
    audit, from_data, note = _own_steps(ev, steps, work)
    data -= min(from_data, data)
    audit.append(Piece("step boundaries", _r(boundaries), _r(boundaries / n)))
    own = sum(p.ms for p in audit)
    span = max(span, sum(s.ms for s in steps) + between_ms + boundaries)  # (the parts never pass it)
    base = (span - own) / n
    totals = {"work": sum(work.values()) - (own - boundaries - from_data), "data": data, "between": between_ms,
              "syncs": syncs, "rest": rest, "audit": own}
    parts = [Part(name, _r(ms), _r(ms / n), round(ms / n / base, 4) if base > 0 else 0.0,
                  between if name == "between" else [p for p in audit if p.ms > 0] if name == "audit" else [])
             for name, ms in totals.items()]
    basis = ev.median_basis()
    times = sorted(s.time_ms for s in basis)
    unprofiled = [s for s in steps if not s.profiled] or steps
    slowest = sorted(unprofiled, key=lambda s: -s.time_ms)[:SLOWEST]
    timed = len(ev.timed_steps())
    few = timed < ENOUGH_TIMED
    return RunTime(source="run", steps=n, span_ms=_r(span), per_step_ms=_r(span / n), base_ms=_r(base), parts=parts,
                   median_ms=_r(statistics.median(times)) if times else None,
                   p10_ms=_r(_quantile(times, 0.1)) if times else None, p90_ms=_r(_quantile(times, 0.9)) if times else None,
                   slowest=[SlowStep(s.index, _r(s.time_ms), _role(s), _waited(*waits[s.index])) for s in slowest],
                   floor_ms=_run_floor(ev), timed_steps=timed,
                   ask_steps=ASK_STEPS if few and 0 < ev.requested_steps < ASK_STEPS else None, note=note)


def _waited(data: float, syncs: float) -> dict[str, float]:
    return {k: _r(v) for k, v in (("data", data), ("syncs", syncs)) if v >= 0.005}


def _quantile(sorted_xs: list[float], q: float) -> float:
    """The q-quantile of sorted values, linearly between the two nearest."""
    pos = q * (len(sorted_xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def _own_steps(ev: m.Evidence, steps: list[m.StepRecord], work: dict[int, float]) -> tuple[list[Piece], float, str]:
    """The checked and the profiled steps' cost: each kind's median step over the timed steps'
    median step, times their number (at most their time: medians, so that a slow first step or a
    stall in some of them is the run's, not the audit's); how much of it is more than those steps'
    work (the checks slow a loader in the training process too: the rest comes out of their data
    waits); and what is not measured."""
    n = len(steps)
    roles: dict[str, list[m.StepRecord]] = {}
    for s in steps:
        roles.setdefault(_role(s), []).append(s)
    timed = roles.get("timed", [])
    base = statistics.median(s.ms for s in timed) if timed else None
    note, out, from_data = "", [], 0.0
    for role, name in (("checked", "checked steps"), ("profiled", "profiled steps")):
        mine = roles.get(role, [])
        against = base
        if against is None and role == "profiled" and roles.get("checked"):
            against = statistics.median(s.ms for s in roles["checked"])  # (no timed step: against the checked ones)
        if mine and against is None:
            note = f"the {name}' cost is not measured: no step ran without the audit's checks"
        extra = 0.0 if not mine or against is None else \
            min(sum(s.ms for s in mine), len(mine) * max(0.0, statistics.median(s.ms for s in mine) - against))
        out.append(Piece(name, _r(extra), _r(extra / n)))
        if extra > 0:
            from_data += _from_data(extra, mine, timed or roles.get("checked", []), work)
    return out, from_data, note


def _from_data(extra: float, mine: list[m.StepRecord], basis: list[m.StepRecord], work: dict[int, float]) -> float:
    """How much of the audit's `extra` time in steps `mine` comes out of their data waits: in
    proportion to how much longer their median wait is than the `basis` steps' (the checks slow a
    loader in the training process), against how much longer their median work is; at most their
    waits, and whatever their work cannot hold."""
    def med(steps: list[m.StepRecord], f: Any) -> float:
        return statistics.median(f(s) for s in steps) if steps else 0.0

    waits = sum(s.ms - work[s.index] for s in mine)
    dd = max(0.0, med(mine, lambda s: s.ms - work[s.index]) - med(basis, lambda s: s.ms - work[s.index]))
    dw = max(0.0, med(mine, lambda s: work[s.index]) - med(basis, lambda s: work[s.index]))
    share = dd / (dd + dw) if dd + dw > 0 else 0.0
    taken = max(extra * share, extra - sum(work[s.index] for s in mine))
    return min(taken, waits)


def own_trace(ev: m.Evidence, trace: Any) -> bool:
    """Whether `trace` is the run's own profiler window (not a recording given beside it)."""
    def name(path: Any) -> str:  # (evidence.json may name it relative to the run, without its .gz)
        return os.path.basename(str(path)).removesuffix(".gz")

    return name(trace.path) in {name(p) for p in (ev.profile.trace_files if ev.profile else [])}


def _run_floor(ev: m.Evidence) -> float | None:
    """The device's own work per step where a run knows it: its trace's busy time, else the device's
    clock of a device-bound run (host-side fixes do not shorten it)."""
    from auditor.evidence.step_clock import bound_of, device_busy_ms

    busy = next((b for t in ev.trace_data if own_trace(ev, t)
                 and (b := device_busy_ms(t)) is not None), None)  # (the run's own window: no trace given beside it)
    if busy is not None:
        return _r(busy)
    basis = ev.median_basis()
    device = [s.device_ms for s in basis if s.device_ms is not None]
    if device and bound_of(statistics.median(s.ms for s in basis), statistics.median(device)) == "device":
        return _r(statistics.median(device))
    return None


# ---------------------------------------------------------------------------------------------
# the time between a whole program's steps, by what the probes timed there

BETWEEN = ("epoch starts", "evaluation", "checkpoints", "syncs", "other")


def _between(ev: m.Evidence, first: int, last: int) -> list[Piece]:
    """The stretches between steps `first` and `last`, by what ran in them (BETWEEN): the training
    loader's new iterators and fetches (a new epoch: its workers' start and stop), forwards and
    other loaders' fetches (an evaluation; its syncs too), torch.save (checkpoints), syncs
    elsewhere (logging), and the rest of the stretch (work no probe times)."""
    training = {t.data.get("loader") for s in ev.steps for t in s.tallies if t.kind == m.DATA_WAIT}
    totals = dict.fromkeys(BETWEEN, 0.0)
    n = max(1, len(ev.steps))
    for o in ev.outside:
        if o.phase != "between" or o.after_step is None or not first <= o.after_step < last:
            continue
        got = _stretch(o, training)
        timed = sum(got.values())
        scale = min(1.0, o.ms / timed) if timed > 0 else 1.0  # (nested calls counted twice: within the stretch)
        for k, v in got.items():
            totals[k] += v * scale
        # (a stretch that only ended an epoch and began the next is that, whole: its old workers'
        # teardown runs in the iterator's finaliser, which no probe times)
        alone = timed > 0 and got["epoch starts"] == timed
        totals["epoch starts" if alone else "other"] += max(0.0, o.ms - timed * scale)
    return [Piece(k, _r(v), _r(v / n)) for k, v in totals.items()]


def _stretch(o: m.Outside, training: set[Any]) -> dict[str, float]:
    forwards = any(t.kind in (m.FORWARD, m.BACKWARD) for t in o.tallies)
    got = dict.fromkeys(BETWEEN[:-1], 0.0)
    for _, t in m.one_fetch([(0, t) for t in o.tallies]):
        if t.kind in (m.DATA_WAIT, m.DATA_ITER):
            # (the training loader's: its epoch's end and a new iterator, its workers stopped and started)
            got["epoch starts" if t.data.get("loader") in training else "evaluation"] += t.ms
        elif t.kind in (m.FORWARD, m.BACKWARD, m.OPTIMIZER):
            got["evaluation"] += t.ms
        elif t.kind == m.SAVE:
            got["checkpoints"] += t.ms
        elif t.kind == m.SYNC:
            got["evaluation" if forwards else "syncs"] += t.ms
    return got


# ---------------------------------------------------------------------------------------------
# a recording's steps

def trace_base_ms(trace: Trace) -> float:
    """A recording's time per step: its steps' span over their number, each step on its bound's
    clock (a device-bound step's device work runs past its host span), with the time between them
    (the whole recording, one step, without steps)."""
    steps = trace.steps
    if not len(steps):
        return trace.step_ms()
    return _trace_span_us(trace) / 1000.0 / len(steps)


def _trace_span_us(trace: Trace) -> float:
    """The steps on their bound's clock and the time between them (us)."""
    from auditor.evidence.trace.intervals import merge_intervals, total_length

    steps = trace.steps
    ts, end = steps["ts"].to_numpy(dtype=float), steps["end"].to_numpy(dtype=float)
    between = float(end.max() - ts.min()) - total_length(merge_intervals(ts, end))
    return float(trace.step_times_ms().sum()) * 1000.0 + between


def of_trace(trace: Trace) -> RunTime | None:
    """A recording's account: its steps on their bound's clock (trace_base_ms), their waits for data
    (DataLoader `__next__`) and syncs (the calls in which the host waited for the device) inside
    them, the auditor's own ranges (an audited run's trace), and the time between them; the device's
    busy time per step as its floor."""
    import numpy as np

    from auditor.evidence.trace.intervals import intersect, merge_intervals, subtract, total_length

    steps = trace.steps
    if not len(steps):
        return None
    n = len(steps)
    ts, end = steps["ts"].to_numpy(dtype=np.float64), steps["end"].to_numpy(dtype=np.float64)
    lo, hi = float(ts.min()), float(end.max())
    inside, data_iv, sync_iv = _trace_waits(trace)
    ranges = trace.auditor_ranges()
    own_iv = subtract(subtract(intersect(merge_intervals(trace.col("ts")[ranges], trace.col("end")[ranges]), inside),
                               data_iv), sync_iv)
    us = {"data": total_length(data_iv), "syncs": total_length(sync_iv), "audit": total_length(own_iv)}
    span = _trace_span_us(trace)  # (a device-bound step's device work past its span is the step's work)
    between = (hi - lo) - total_length(inside)
    totals = {"work": span - between - sum(us.values()), "data": us["data"], "between": between,
              "syncs": us["syncs"], "rest": 0.0, "audit": us["audit"]}
    base = (span - us["audit"]) / 1000.0 / n
    parts = [Part(k, _r(v / 1000.0), _r(v / 1000.0 / n), round(v / 1000.0 / n / base, 4) if base > 0 else 0.0)
             for k, v in totals.items()]
    times = np.sort(trace.step_times_ms())
    device = trace.device_step_ms()
    per_step = [(total_length(intersect((np.array([a]), np.array([b])), data_iv)) / 1000.0,
                 total_length(intersect((np.array([a]), np.array([b])), sync_iv)) / 1000.0) for a, b in zip(ts, end)]
    order = np.argsort(-trace.step_times_ms(), kind="stable")[:SLOWEST]
    numbers = steps["step"].to_numpy()
    return RunTime(source="trace", steps=n, span_ms=_r(span / 1000.0), per_step_ms=_r(span / 1000.0 / n),
                   base_ms=_r(base), parts=parts, median_ms=_r(float(np.median(times))),
                   p10_ms=_r(_quantile(times.tolist(), 0.1)), p90_ms=_r(_quantile(times.tolist(), 0.9)),
                   slowest=[SlowStep(int(numbers[k]), _r(float(trace.step_times_ms()[k])), "", _waited(*per_step[k]))
                            for k in order],
                   floor_ms=_r(float(np.nanmean(device))) if np.isfinite(device).any() else None,
                   trace=trace.label)


def _trace_waits(trace: Trace) -> tuple[Any, Any, Any]:
    """A recording's steps' intervals (us): (inside the steps, their waits for data (DataLoader
    `__next__`), their syncs (the calls in which the host waited for the device), not data)."""
    from auditor.evidence.trace.decode import CAT
    from auditor.evidence.trace.intervals import intersect, merge_intervals, subtract
    from auditor.evidence.trace.queries import DATALOADER_NEXT, blocking_calls

    steps = trace.steps
    inside = merge_intervals(steps["ts"].to_numpy(dtype=float), steps["end"].to_numpy(dtype=float))
    loader = trace.matching(DATALOADER_NEXT)
    loader = loader[loader["cat"].isin((CAT["cpu_op"], CAT["annotation"])) & ~loader["instant"]]
    data_iv = intersect(merge_intervals(loader["ts"].to_numpy(), loader["end"].to_numpy()), inside)
    rows = blocking_calls(trace)
    sync_iv = subtract(intersect(merge_intervals(trace.col("ts")[rows], trace.col("end")[rows]), inside), data_iv)
    return inside, data_iv, sync_iv


# ---------------------------------------------------------------------------------------------
# the account step by step: how much its figures move from one step to the next

def per_step(ev: m.Evidence) -> dict[str, list[float]] | None:
    """The run's time of each step and its parts, in ms, for the noise of the account's figures
    (auditor.evidence.compare): `run`, from the step's start to the next one's (the last step:
    its own time), less the audit's work at that boundary; `work`, `data`, `syncs` in the step;
    `between`, the stretch after it. A run's timed steps (the checked and profiled ones carry
    the audit's own work; all of them where fewer than two are timed), a recording's every step
    on its bound's clock. None where run_time is."""
    if ev.steps:
        return _per_run_step(ev)
    trace = ev.shown_trace()
    return _per_trace_step(trace) if trace is not None and len(trace.steps) else None


def _per_run_step(ev: m.Evidence) -> dict[str, list[float]]:
    steps = sorted(ev.steps, key=lambda s: s.start_s)
    after: dict[int, float] = {}
    for o in ev.outside:
        if o.phase == "between" and o.after_step is not None:
            after[o.after_step] = after.get(o.after_step, 0.0) + o.ms
    timed = {s.index for s in ev.timed_steps()}
    if len(timed) < 2:
        timed = {s.index for s in steps}
    out: dict[str, list[float]] = {k: [] for k in ("run", "work", "data", "syncs", "between")}
    for k, s in enumerate(steps):
        if s.index not in timed:
            continue
        nxt = steps[k + 1] if k + 1 < len(steps) else None
        data, syncs = _waits(s)
        between = after.get(s.index, 0.0) if nxt is not None else 0.0
        run = ((nxt.start_s - s.start_s) * 1e3 - (nxt.own_before_ms or 0.0)) if nxt is not None else s.ms
        for key, v in (("run", max(run, s.ms)), ("work", s.ms - data - syncs), ("data", data), ("syncs", syncs),
                       ("between", between)):
            out[key].append(v)
    return out


def _per_trace_step(trace: Trace) -> dict[str, list[float]]:
    import numpy as np

    from auditor.evidence.trace.intervals import intersect, total_length

    steps = trace.steps
    ts, end = steps["ts"].to_numpy(dtype=np.float64), steps["end"].to_numpy(dtype=np.float64)
    order = np.argsort(ts, kind="stable")
    times = trace.step_times_ms()
    _, data_iv, sync_iv = _trace_waits(trace)
    out: dict[str, list[float]] = {k: [] for k in ("run", "work", "data", "syncs", "between")}
    for j, k in enumerate(order.tolist()):
        window = (np.array([ts[k]]), np.array([end[k]]))
        data = total_length(intersect(window, data_iv)) / 1000.0
        syncs = total_length(intersect(window, sync_iv)) / 1000.0
        gap = max(0.0, float(ts[order[j + 1]] - end[k]) / 1000.0) if j + 1 < len(order) else 0.0
        step = float(times[k])
        for key, v in (("run", step + gap), ("work", step - data - syncs), ("data", data), ("syncs", syncs),
                       ("between", gap)):
            out[key].append(v)
    return out
