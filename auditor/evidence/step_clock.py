"""Which clock a step is on, and so what its fixes can save: the host's or the device's.

A step has two clocks. The host's is the time the program takes to issue the step (its Python, its
launches, its waits); the device's is the time the device takes to run what was issued, from the
step's beginning to the end of its last kernel on the stream it used. The step lasts the longer of
the two, and that one is its bound:

* host-bound: the device finishes each step's work before the host has issued the next; the step
  is the host's issue time, and host-side savings shorten it. The device's own work (its busy
  time, from a trace) is what no host-side fix can take away; faster device work shortens the
  step only where the host waits for it (the device's work inside the host's syncs, `waited_ms`).
* device-bound: the host runs ahead and waits for the device; the step is the device's time, and a
  host-side saving shortens it only by what the host's time exceeds the device's (nothing, while the
  device stays the longer).

A run measures both clocks per step (auditor.capture.device_clock); a recording gives them per
ProfilerStep (its host span against the busy time of the kernels its launches made); a CUDA program
rehearsed on a CPU has the device model's estimate of its kernels' time instead of a device clock.
A step is device-bound when its device time exceeds its host time by DEVICE_MARGIN: a host-bound
step's device span is its host time plus the last kernel's tail.
"""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from auditor.evidence.model import Evidence

DEVICE_MARGIN = 1.10  # device median over host median above which the steps are device-bound
# A recording's step whose device is busy this share of its host span or more, while the host
# waits for the device (its blocking calls hold device work) HOST_WAITS of the span or more, is
# device-bound too: the host finishes issuing and then waits for the device's work to end
DEVICE_BUSY = 0.8
HOST_WAITS = 0.1


class StepClock(msgspec.Struct, frozen=True):
    """The reported step and its bound (findings.json `steps.bound`, `steps.host_ms`, ...)."""

    bound: str | None  # "host" | "device"; None: no device time is known (a CPU program)
    step_ms: float | None  # the median step on its bound's clock: what every share is of
    host_ms: float | None  # median of the same steps on the host's clock
    device_ms: float | None  # median on the device's clock (None: not measured)
    # The device's own work per step (kernels, copies, memsets merged), when a trace shows it:
    # what no host-side fix removes from a step
    device_busy_ms: float | None = None
    # The device's work the host waited for per step (inside its syncs), from a trace: all that a
    # device-side fix can take off a host-bound step (None: no trace tells)
    waited_ms: float | None = None
    source: str = "host"  # "events" | "trace" | "estimate" (rehearsal's device model) | "host"
    steps: int = 0  # how many steps the medians are over
    note: str = ""  # why a clock was not used (device events that never completed, streams switched)
    # A rehearsal's: the least the host would take to issue a step on the GPU (rehearsed_issue_floor_ms);
    # its host_ms holds the kernels' own work, which this CPU did
    issue_floor_ms: float | None = None
    # A rehearsal's: the least time its DataLoader's workers take to make a step's batches
    # (data_supply.Supply.ms_per_step of the slowest), where they set issue_floor_ms
    data_supply_ms: float | None = None


def bound_of(host_ms: float | None, device_ms: float | None) -> str | None:
    if host_ms is None or device_ms is None:
        return None
    return "device" if device_ms > DEVICE_MARGIN * host_ms else "host"


def of_trace(trace: Any) -> StepClock:
    """A recording's steps: each ProfilerStep's host span against its kernels' busy time."""
    import numpy as np

    if not len(trace.steps):
        return StepClock(bound=None, step_ms=trace.median_step_ms(), host_ms=trace.median_step_ms(),
                         device_ms=None, source="trace")
    host = trace.host_step_ms()
    device = trace.device_step_ms()
    known = np.isfinite(device)
    host_ms = float(np.median(host))
    device_ms = float(np.median(device[known])) if known.any() else None
    waited = waited_ms(trace)
    bound = bound_of(host_ms, device_ms)
    if (bound == "host" and device_ms is not None and waited is not None and device_ms >= DEVICE_BUSY * host_ms
            and waited >= HOST_WAITS * host_ms):
        bound = "device"
    return StepClock(bound=bound, step_ms=trace.median_step_ms(), host_ms=host_ms,
                     device_ms=device_ms, device_busy_ms=device_busy_ms(trace), waited_ms=waited,
                     source="trace", steps=len(host))


def waited_ms(trace: Any) -> float | None:
    """The device's work the host waited for, per step of a trace: the time inside the host's
    blocking calls in the steps (syncs, copies to pageable memory: evidence.trace.queries.blocking_calls)
    during which the device ran work (whoever launched it: a backlog the sync waits for too), over the steps. On a host-bound step that is all
    a faster kernel can take off the step: elsewhere the host is issuing, and the device's work
    runs beside it. None without steps."""
    from auditor.evidence.trace.intervals import intersect, merge_intervals, total_length
    from auditor.evidence.trace.queries import blocking_calls

    if not len(trace.steps):
        return None
    if "_waited_ms" not in trace.__dict__:
        import numpy as np

        lo, hi = float(trace.steps["ts"].min()), float(trace.steps["end"].max())
        rows = blocking_calls(trace)
        ts, end = trace.col("ts")[rows], trace.col("end")[rows]
        ok = np.isfinite(ts) & np.isfinite(end) & (end > ts)
        waits = merge_intervals(np.clip(ts[ok], lo, hi), np.clip(end[ok], lo, hi))
        from auditor.evidence.trace.decode import GPU_WORK

        cat, kts, kend = trace.col("cat"), trace.col("ts"), trace.col("end")
        good = np.isin(cat, GPU_WORK) & np.isfinite(kts) & np.isfinite(kend) & (kend >= kts)
        busy = merge_intervals(kts[good], kend[good])
        trace.__dict__["_waited_ms"] = total_length(intersect(waits, busy)) / 1000.0 / len(trace.steps)
    return trace.__dict__["_waited_ms"]


def device_busy_ms(trace: Any) -> float | None:
    """The device's busy time per step in a trace: each step's (Trace.device_step_ms: its work inside
    the step's host span, or, where more, the work its launches made, after the span), over the
    steps; None without steps or GPU work."""
    import numpy as np

    if not len(trace.steps):
        return None
    if "_device_busy_ms" not in trace.__dict__:  # (each report asks: it is read once)
        per_step = trace.device_step_ms()
        known = np.isfinite(per_step)
        trace.__dict__["_device_busy_ms"] = float(per_step[known].sum()) / len(trace.steps) if known.any() else None
    return trace.__dict__["_device_busy_ms"]


def of_run(ev: Evidence, estimated_device_ms: float | None = None) -> StepClock:
    """A run's timed steps on both clocks. `estimated_device_ms`: the device model's kernel time
    per step for a rehearsed CUDA program (no device clock there)."""
    steps = ev.median_basis()
    if not steps:
        return StepClock(bound=None, step_ms=None, host_ms=None, device_ms=None)
    host_ms = statistics.median(s.ms for s in steps)
    measured = [s.device_ms for s in steps if s.device_ms is not None]
    traced = next((t for t in ev.trace_data if device_busy_ms(t) is not None), None)
    busy = device_busy_ms(traced) if traced is not None else None
    waited = waited_ms(traced) if traced is not None else None
    note = next((n for n in ev.environment.notes if n.startswith(DEVICE_CLOCK_NOTE)), "")
    if measured:
        device_ms = statistics.median(measured)
        return StepClock(bound=bound_of(host_ms, device_ms), step_ms=ev.median_step_ms(), host_ms=host_ms,
                         device_ms=device_ms, device_busy_ms=busy, waited_ms=waited, source="events",
                         steps=len(steps), note=note)
    if estimated_device_ms is not None:
        # The rehearsed host time holds the kernels' own work, done on this CPU: host-bound on the
        # GPU only where the least the host would take to issue the step exceeds the kernels'
        # estimate, device-bound where the kernels exceed all of the host's time here, else not known.
        from auditor.evidence.data_supply import worker_supply

        supply = worker_supply(ev, steps)
        least = supply[0].ms_per_step if supply else 0.0
        floor = rehearsed_issue_floor_ms(ev, steps, least)
        bound = "host" if floor is not None and estimated_device_ms <= floor else (
            "device" if bound_of(host_ms, estimated_device_ms) == "device" else None)
        feeds = least if supply and floor is not None and least >= 0.999 * floor else None
        return StepClock(bound=bound, step_ms=ev.median_step_ms(),
                         host_ms=host_ms, device_ms=estimated_device_ms, device_busy_ms=estimated_device_ms,
                         source="estimate", steps=len(steps), note=note, issue_floor_ms=floor,
                         data_supply_ms=feeds)
    return StepClock(bound=None, step_ms=ev.median_step_ms(), host_ms=host_ms, device_ms=None,
                     device_busy_ms=busy, waited_ms=waited, source="host", steps=len(steps), note=note)


def rehearsed_issue_floor_ms(ev: Evidence, steps: list, least: float | None = None) -> float | None:
    """For a CUDA program rehearsed on a CPU: the least time the host would take to issue a step on
    the named device (the median over `steps` of rehearsed_host_steps; `least` as there)."""
    per_step = rehearsed_host_steps(ev, steps, least=least)
    return statistics.median(host for _, host in per_step) if per_step else None


def rehearsed_host_steps(ev: Evidence, steps: list, measured: bool = True,
                         least: float | None = None) -> list[tuple[float, float]] | None:
    """For a CUDA program rehearsed on a CPU, each step's (wait for data, least time to issue it)
    on the named device: one launch time (the row's launch_us) per kernel, the launches as
    rehearsed, those autograd recorded x BACKWARD_FACTOR for the backward (as rehearsed_device_ms
    counts them), and its waits
    for data, which no GPU shortens: those measured here (a loader without workers makes its batches
    in the step), or, where its DataLoader's workers cannot make its batches in that time
    (data_supply: their CPU time a batch over their number), the rest of theirs. The rest of the
    host's time here is mostly the kernels' work, which this CPU did and a GPU takes off the host.
    `measured=False` leaves the waits measured here out (the workers' part alone); `least`: the
    slowest workers' time a step, where the caller has it (else read from the evidence). None: not
    a rehearsal."""
    from auditor.evidence import model as m
    from auditor.evidence.data_supply import worker_supply

    device = _rehearsal_device(ev)
    if device is None:
        return None
    if least is None:
        supply = worker_supply(ev, steps)
        least = supply[0].ms_per_step if supply else 0.0
    per_step = []
    for s in steps:
        waits = sum(t.ms for t in s.tallies if t.kind in (m.DATA_WAIT, m.DATA_ITER)) if measured else 0.0
        launches = sum(t.count * backward_factor(t) for t in s.tallies if t.kind == m.DEVICE_LAUNCH) * device.launch_us / 1e3
        wait = max(waits, least - launches, 0.0)
        per_step.append((wait, launches + wait))
    return per_step


def _rehearsal_device(ev: Evidence) -> Any:
    from auditor.evidence.devices import DEFAULT_DEVICE, find_device

    if not ev.environment.rehearsal:
        return None
    return (find_device(ev.environment.device_model) if ev.environment.device_model else None) or \
        find_device(DEFAULT_DEVICE)


DEVICE_CLOCK_NOTE = "device clock:"  # an environment note the capture adds when it fell back to the host's


BACKWARD_FACTOR = 3.0  # a call's kernel work with its backward over its own: the backward does about twice


def backward_factor(tally: Any) -> float:
    """What a rehearsed launch tally counts for with the backward pass, which a rehearsal does not see:
    BACKWARD_FACTOR for calls autograd recorded, 1 for those it did not (under no_grad: an
    evaluation's forward, an update loop). A tally recorded before the flag was kept counts as
    recorded."""
    return BACKWARD_FACTOR if tally.data.get("grad", 1) else 1.0


def rehearsed_device_ms(ev: Evidence) -> tuple[float, str] | None:
    """For a CUDA program rehearsed on a CPU: the device model's estimate of a step's kernel time
    on the named device (`--device`, else the default row), and that device's name. Each kernel the
    step's calls would launch (evidence.model.DEVICE_LAUNCH) at its bytes over the row's memory
    bandwidth or its FLOPs over its peak, whichever is longer; the backward pass, which a rehearsal
    does not see, as BACKWARD_FACTOR times the calls autograd recorded (backward_factor). None: not
    a rehearsal, or no launches."""
    from auditor.evidence import model as m

    device = _rehearsal_device(ev)
    if device is None:
        return None
    per_step = []
    for s in ev.timed_steps() or [s for s in ev.steps if not s.failed and not s.profiled]:
        us = 0.0
        for t in s.tallies:
            if t.kind == m.DEVICE_LAUNCH and t.count:
                nbytes, flops = t.data.get("bytes", 0) / t.count, t.data.get("flops", 0) / t.count
                memory = nbytes / (device.mem_bw_gbs * 1e9) * 1e6
                compute = flops / (device.peak_tflops(t.data.get("dtype", "") or "float32") * 1e12) * 1e6
                us += t.count * max(memory, compute) * backward_factor(t)
        per_step.append(us)
    if not per_step or not any(per_step):
        return None
    return statistics.median(per_step) / 1e3, device.name


def step_clock(ev: Evidence, trace: Any = None) -> StepClock:
    """The clock of the steps a cost is per: the run's, also for a finding on the run's own
    profiler trace; a recording analysed on its own, its trace's (as findings.step_basis_ms)."""
    if ev.steps or trace is None:
        if not ev.steps:
            t = next((t for t in ev.trace_data if len(t.steps)), None)
            if t is not None:
                return of_trace(t)
        estimate = rehearsed_device_ms(ev)
        return of_run(ev, estimate[0] if estimate is not None else None)
    return of_trace(trace)
