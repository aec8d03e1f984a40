"""Costs as what each fix saves, once all rules have judged: idle time counted once, by the finding
that names its cause, and every time cost taken on the step's critical path.

Two passes over the findings of one evidence (run_rules calls `attribute`):

* Idle time belongs to its cause. gpu-idle splits the GPU's idle by what the host did meanwhile
  (auditor.evidence.trace.gaps): waiting for data, a device sync, other host work, the launches.
  Where another finding on the same steps names that cause and carries a time cost of its own
  (EXPLAINED_BY: dataloader-bound for data waits, host-sync for syncs, launch-bound for host work
  and launches; forced-cleanup's, anomaly mode's and peak-stat resets' host time out of "host work"), that finding
  takes the idle up to its own cost (what its fix saves: a sync's wait, not the host work after it
  that the step still does), gpu-idle's cost keeps only what no other finding explains, and the findings it held (Cost.within "gpu-idle")
  count their own cost. What is left below gpu-idle's `min-idle-share` of the step makes it `info`.
* A cost is what its fix takes off the step on the step's bound (auditor.evidence.step_clock,
  auditor.findings.saving_on_path): a host-side saving on a device-bound step saves only what the
  host's time exceeds the device's, and on a host-bound step at most the step less the device's
  own work; a device-side saving (Rule.saves_on "device") on a device-bound step at most what the
  device's time exceeds the host's, and on a host-bound step at most the device's work the host
  waits for in its syncs (StepClock.waited_ms, from a trace): the rest of the device's work runs
  while the host issues, and faster kernels take nothing off the host's time there. A cost changed so says so at the end of its message, with its share of the
  reported step.
* A warning with no predicted saving says why in its message (its cost's note).
* Fixes in the order they can be applied (ORDER): dataloader-bound's more workers after
  dataloader-on-device's data built on the CPU; the later one says so, and auditor.verify applies
  the earlier one's edits first.
"""
from __future__ import annotations

from typing import Any

import msgspec

from auditor.evidence.model import Evidence
from auditor.evidence.step_clock import StepClock, step_clock
from auditor.findings import Finding, saving_on_path, share_of_step, step_basis_ms

# gpu-idle's causes (auditor.evidence.trace.gaps.HOST_CAUSES) whose idle a warning naming them takes whole
# (a peak-stat reset is no sync: it resets the allocator's counters on the host, with no CUDA call;
# an H100 recording of examples/demo.py, tests/rules/test_peak_stats_no_sync.py)
TAKEN_BY = {
    "data loading": ("dataloader-bound", "dataloader-on-device"),
    "host synchronisation": ("host-sync",),
}
# ... and the rules whose findings carry each cause up to their own cost
EXPLAINED_BY = {
    "data loading": ("dataloader-bound", "dataloader-on-device"),
    "host synchronisation": ("host-sync",),
    "host work": ("launch-bound",),
    "launch": ("launch-bound",),
}
# Rules whose cost is host time spent outside launches and syncs: while it runs the GPU idles in
# gpu-idle's "host work", so that much of it is theirs
HOST_WORK_RULES = ("forced-cleanup", "anomaly-mode", "peak-stats-reset")


def _trace_of(ev: Evidence, f: Finding) -> Any:
    path = f.evidence.get("trace") if isinstance(f.evidence, dict) else None
    if not isinstance(path, str):
        return None
    return next((t for t in ev.trace_data if str(t.path) == path), None)


def _same_steps(ev: Evidence, f: Finding, g: Finding) -> bool:
    """Whether `g`'s cost is per step of the steps `f`'s is: the same recording, or a run's own
    finding beside a finding on that run's profiled window."""
    ft, gt = f.evidence.get("trace"), g.evidence.get("trace")
    return ft == gt or (ev.source == "run" and gt is None)


def _timed(f: Finding) -> float | None:
    return f.cost.ms_per_step if f.cost is not None else None


def _idle_once(ev: Evidence, findings: list[Finding], min_idle_share: float) -> list[Finding]:
    out = list(findings)
    for i, f in enumerate(out):
        if f.rule != "gpu-idle" or _timed(f) is None or not isinstance(f.evidence.get("idle_by_cause_ms_per_step"), dict):
            continue
        by_cause = f.evidence["idle_by_cause_ms_per_step"]
        peers = [g for g in out if g is not f and _same_steps(ev, f, g)]
        explained: dict[str, float] = {}
        # A data wait's or a sync's idle is its finding's: the fix gives it back. A warning naming
        # it takes all of it (its cost raised to it when lower: a sync call's own time is not the
        # idle it leaves behind until the host's next launch), shared in proportion to the costs
        # of the warnings naming one cause.
        raised: dict[int, tuple[float, str]] = {}
        for cause, rules in TAKEN_BY.items():
            idle = float(by_cause.get(cause, 0.0))
            takers = [g for g in peers if g.rule in rules and g.severity != "info" and g.cost is not None]
            if idle <= 0 or not takers:
                continue
            weights = [_timed(g) or 0.0 for g in takers]
            total = sum(weights)
            for g, w in zip(takers, weights):
                part = idle * (w / total if total > 0 else 1.0 / len(takers))
                explained[g.rule] = explained.get(g.rule, 0.0) + part
                if part > (_timed(g) or 0.0) + 0.0005:
                    raised[out.index(g)] = (part, cause)
        # Other findings take the idle of their causes up to their own cost (what their fixes
        # save): launch-bound's launch-starved gaps are some of the host's issuing idle, not all
        timed_peers = [g for g in peers if _timed(g) is not None]
        for cause, rules in EXPLAINED_BY.items():
            idle = float(by_cause.get(cause, 0.0)) - sum(explained.get(r, 0.0) for r in TAKEN_BY.get(cause, ()))
            g = next((g for g in timed_peers if g.rule in rules), None)
            if g is not None and idle > 0:
                take = min(idle, (_timed(g) or 0.0) - explained.get(g.rule, 0.0))
                if take > 0:
                    explained[g.rule] = explained.get(g.rule, 0.0) + take
        for j, (ms, cause) in raised.items():
            out[j] = _raised(out[j], ms, cause, step_basis_ms(ev, _trace_of(ev, f)))
        host_work = float(by_cause.get("host work", 0.0)) - explained.get("launch-bound", 0.0)
        for g in peers:
            if g.rule in HOST_WORK_RULES and host_work > 0:
                take = min(host_work, _timed(g) or 0.0)
                explained[g.rule] = explained.get(g.rule, 0.0) + take
                host_work -= take
        if not explained:
            continue
        claim = f.cost.ms_per_step  # type: ignore[union-attr]
        rest = round(max(0.0, claim - sum(explained.values())), 3)  # type: ignore[operator]
        step = step_basis_ms(ev, _trace_of(ev, f))
        share = share_of_step(rest, step)
        told = "; ".join(f"{ms:.2f} ms {rule}" if ms >= 0.005 else f"{ms:.3g} ms {rule}"
                         for rule, ms in sorted(explained.items(), key=lambda kv: -kv[1]))
        message = (f"{f.message} Of the {claim:.2f} ms per step of idle the host caused, {claim - rest:.2f} ms is "
                   f"counted by the findings that name its cause ({told}): gpu-idle counts the other {rest:.2f} ms.")
        evidence = dict(f.evidence, explained_by_ms_per_step={k: round(v, 3) for k, v in explained.items()},
                        unexplained_ms_per_step=rest)
        severity = f.severity
        if share is None or share < min_idle_share:
            severity = "info"
            message += (" What is left is under " f"{min_idle_share:.0%} of the step: the findings named are the "
                        "ones to act on.")
        cost = msgspec.structs.replace(f.cost, ms_per_step=rest, share_of_step=share, within=None)
        out[i] = msgspec.structs.replace(f, message=message, evidence=evidence, severity=severity, cost=cost)
        for j, g in enumerate(out):  # what gpu-idle held is now counted by its own finding
            if g.cost is not None and g.cost.within == "gpu-idle" and _same_steps(ev, f, g):
                out[j] = msgspec.structs.replace(g, cost=msgspec.structs.replace(g.cost, within=None))
    return out


def _raised(g: Finding, ms: float, cause: str, step: float | None) -> Finding:
    """`g` with the idle of `cause` it takes from gpu-idle as its cost (more than it measured)."""
    c = g.cost
    assert c is not None
    before = c.ms_per_step
    ms = round(ms, 3)
    share = share_of_step(ms, step)
    what = "waiting for data" if cause == "data loading" else "behind its syncs, until the host's next launch"
    message = (f"{g.message} The GPU idles {ms:.2f} ms per step {what} (gpu-idle's trace"
               + (f", {share:.0%} of the run's time" if share is not None else "")
               + "): its fix gives that back, so that is its cost"
               + (f" (its calls themselves took {before:.2f} ms)." if before is not None else "."))
    note = (f"the GPU's idle {what}, from the profiler trace: what the fix gives back"
            + (f"; {c.note}" if c.note else ""))
    evidence = dict(g.evidence, idle_ms_per_step=ms, own_ms_per_step=before)
    return msgspec.structs.replace(g, message=message, evidence=evidence, cost=msgspec.structs.replace(
        c, ms_per_step=ms, share_of_step=share, measured=True, note=note, within=None))


def _clock_phrase(clock: StepClock) -> str:
    if clock.bound == "device":
        return (f"the step is device-bound (the device's {clock.device_ms:.2f} ms per step against the host's "
                f"{clock.host_ms:.2f} ms)")
    busy = f", {clock.device_busy_ms:.2f} ms of it the device's own work" if clock.device_busy_ms else ""
    return f"the step is host-bound (the host's {clock.host_ms:.2f} ms per step{busy})"


def _on_path(ev: Evidence, f: Finding, side: str, clocks: dict) -> Finding:
    c = f.cost
    if c is None or c.ms_per_step is None:
        return f
    trace = _trace_of(ev, f)
    key = None if trace is None else str(trace.path)
    if key not in clocks:  # (one clock per trace: its busy time is a pass over the trace)
        clocks[key] = step_clock(ev, trace)
    clock = clocks[key]
    saved = round(saving_on_path(c.ms_per_step, side, clock.bound, clock.host_ms, clock.device_ms,
                                 clock.device_busy_ms, clock.waited_ms), 3)
    if saved >= c.ms_per_step - 0.0005:
        return f
    step = step_basis_ms(ev, trace)
    share = share_of_step(saved, step)
    where = "the device's work" if side == "device" else "the host's time"
    if side == "device" and clock.bound == "host" and clock.waited_ms is not None:
        # (a host-bound step: faster device work shortens only the host's waits for it)
        where += (f", which shortens a host-bound step only where the host waits for the device: "
                  f"{clock.waited_ms:.2f} ms per step of device work inside its syncs")
    message = (f"{f.message} Its fix takes {saved:.2f} ms per step off the step"
               + (f" ({share:.0%} of the run's time)" if share is not None else "")
               + f", not the {c.ms_per_step:.2f} ms measured: {_clock_phrase(clock)}, and it shortens {where}.")
    note = (f"what the fix saves on the step's critical path ({clock.bound}-bound): {saved:g} of the "
            f"{c.ms_per_step:g} ms/step measured" + (f"; {c.note}" if c.note else ""))
    evidence = dict(f.evidence, measured_ms_per_step=c.ms_per_step, bound=clock.bound)
    if side == "device" and clock.bound == "host" and clock.waited_ms is not None:
        evidence["waited_ms_per_step"] = round(clock.waited_ms, 3)
    return msgspec.structs.replace(f, message=message, evidence=evidence, cost=msgspec.structs.replace(
        c, ms_per_step=saved, share_of_step=share, note=note))


# Fixes that work only once another's is in: (rule, the rule whose fix goes first, why). auditor.verify
# applies the first's edits before the second's (evidence `apply_after`).
ORDER = (
    ("dataloader-bound", "dataloader-on-device",
     "its Dataset makes CUDA tensors, which DataLoader worker processes cannot (CUDA does not run in a forked "
     "worker: \"AcceleratorError in DataLoader worker process 0\"), so more workers work only once the data is "
     "built on the CPU"),
)


def _in_order(ev: Evidence, findings: list[Finding]) -> list[Finding]:
    out = list(findings)
    for i, f in enumerate(out):
        for rule, first, why in ORDER:
            if f.rule == rule and f.fix is not None and any(
                    g.rule == first and _same_steps(ev, f, g) or g.rule == first and _same_steps(ev, g, f)
                    for g in out):
                after = [*f.evidence.get("apply_after", []), first]
                out[i] = f = msgspec.structs.replace(
                    f, message=f"{f.message} Apply its fix after {first}'s: {why}.",
                    evidence=dict(f.evidence, apply_after=after))
    return out


def attribute(ev: Evidence, findings: list[Finding], sides: dict[str, str], min_idle_share: float) -> list[Finding]:
    """The findings with their costs what their fixes save, and fixes that depend on another's
    saying so (see the module doc). `sides`: each rule's Rule.saves_on."""
    out = _in_order(ev, _idle_once(ev, findings, min_idle_share))
    clocks: dict = {}
    return [_why_untimed(_on_path(ev, f, sides.get(f.rule, "host"), clocks)) for f in out]


def _why_untimed(f: Finding) -> Finding:
    """A warning whose saving no estimate can defend says why in its message (its cost's note)."""
    c = f.cost
    if f.severity == "info" or c is None or c.ms_per_step is not None or not c.note or c.note.rpartition('; ')[2] in f.message:
        return f
    return msgspec.structs.replace(f, message=f"{f.message} Its saving is not predicted: {c.note}.")
