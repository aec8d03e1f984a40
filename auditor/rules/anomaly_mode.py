"""anomaly-mode: autograd anomaly detection left on during training steps."""
from __future__ import annotations

from typing import Iterable

from auditor.evidence import model as m
from auditor.rules.base import Options, Rule
from auditor.findings import Cost, Finding, Fix, share_of_step, step_basis_ms
from auditor.rules._support.places import by_place, locations
from auditor.fixes import replace_in_line
from auditor.rules.suppression import unsuppressed


# What turning anomaly detection off saves, as a share of the backward pass run under it (the part
# of the step the probes time): its checks of each backward node's results for NaN (a pass over
# every gradient, and on a GPU a sync per node) and the traceback it records at each forward op.
# examples/anomaly_mode.py's step on a 2-core CPU, with and without it, 50 steps each, interleaved:
# 2.53 ms saved of a 7.04 ms backward on the process's CPU clock (1 thread; the backward +1.55 ms,
# the forward +1.22 ms), 17.7 of 54.3 ms (wall, 1 thread), 277 of 815 ms (wall, 2 threads, loaded):
# 0.33-0.36 each time. Half the backward, as this was, predicted 1.4-1.5x the saving measured.
ANOMALY_BACKWARD_SHARE = 0.35


def predicted_saving(ev: m.Evidence, on_steps: list[int]) -> Cost:
    """What turning anomaly detection off saves per step: ANOMALY_BACKWARD_SHARE of the median
    backward time (the backward probe's) of the steps that ran with it on, times the share of
    steps that did; counted only when no backward was timed."""
    on = set(on_steps)
    per: dict[int, float] = {}
    for i, t in ev.tallies(m.BACKWARD):
        if i in on:
            per[i] = per.get(i, 0.0) + t.ms
    if not per:
        return Cost(ms_per_step=None, share_of_step=None, measured=False,
                    note="counted only: no backward pass was timed in the steps with anomaly detection on")
    import statistics

    backward = statistics.median(per.values())
    ms = round(ANOMALY_BACKWARD_SHARE * backward * len(on) / max(1, len(ev.steps)), 3)
    return Cost(ms_per_step=ms, share_of_step=share_of_step(ms, step_basis_ms(ev)), measured=False,
                note=f"estimate: {ANOMALY_BACKWARD_SHARE:.0%} of the {backward:.2f} ms median backward pass under "
                     "anomaly detection (its NaN checks in the backward and the tracebacks it records in the "
                     "forward take about that much, measured on examples/anomaly_mode.py)")


class AnomalyMode(Rule):
    """
    What it detects:
        Steps that ran with autograd anomaly detection on (`torch.autograd.set_detect_anomaly(True)`
        or `with torch.autograd.detect_anomaly():`), and the line that switched it on.

    Why it costs:
        Anomaly mode records a Python traceback for every operation in the forward pass and checks
        every backward result for NaN, which synchronises with the device. Steps typically run
        several times slower. It is a debugging aid, not something to train with.

    Example:
        bad:   torch.autograd.set_detect_anomaly(True)      # at import, "just in case"
        good:  enable it only while chasing a NaN, for a few steps, then remove it

    Fix:
        Remove the call or pass False. The code patch turns `set_detect_anomaly(True)` into
        `set_detect_anomaly(False)`; a `detect_anomaly()` block must be removed by hand.

    Evidence needed:
        A run (`audit run`): the probe on torch.set_anomaly_enabled (the line that switched it on),
        the per-step anomaly flag read at each step's start, and the backward probe's mark of a
        backward that ran with anomaly detection on (a `with` block inside the step).
    """

    id = "anomaly-mode"
    title = "Autograd anomaly detection is on during training"
    severity = "warning"
    warns_uncounted = "anomaly detection checks every op of every backward: one line turns it off"
    category = "performance"
    needs = frozenset({"run"})

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        tallies = ev.tallies(m.ANOMALY_ON, include_setup=True)
        # on at the step's start (switched on at import or by an earlier step), or on while one of
        # the step's backward passes ran (switched on and off inside the step, e.g. in a `with`)
        under = {i for i, t in tallies if t.what == m.ANOMALY_BACKWARD and i >= 0}
        on_steps = [s.index for s in ev.steps if s.anomaly_enabled or s.index in under]
        places = unsuppressed(self.id, by_place([(i, t) for i, t in tallies if t.what != m.ANOMALY_BACKWARD]),
                              lambda p: p.where)
        if not on_steps:
            return
        # the line that switched it on; failing that (switched on where no probe saw it), the backward
        locs = locations(places) or locations(by_place([(i, t) for i, t in tallies if t.what == m.ANOMALY_BACKWARD]))
        edits = [e for loc in locs if (e := replace_in_line(loc.file, loc.line, "set_detect_anomaly(True)",
                                                             "set_detect_anomaly(False)"))]
        where = f" (switched on at {locs[0].file}:{locs[0].line})" if locs else ""
        cost = predicted_saving(ev, on_steps)
        saving = "" if cost.ms_per_step is None else (
            f" Turning it off saves about {cost.ms_per_step:.2f} ms per step"
            + (f" ({cost.share_of_step:.0%} of the run's time)" if cost.share_of_step is not None else "")
            + f": {cost.note.removeprefix('estimate: ')}.")
        yield self.finding(
            "Anomaly detection is on in training: turn it off. "
            f"Anomaly detection was on in {len(on_steps)} of {len(ev.steps)} steps{where}; it records a "
            "traceback per forward op and checks every backward result, slowing each step." + saving,
            locations=locs,
            evidence={"steps_with_anomaly": len(on_steps), "steps": len(ev.steps),
                      "switched_on": [{"file": p.where.file, "line": p.where.line, "count": p.count}
                                      for p in places if p.where]},
            cost=cost,
            fix=Fix(summary="Turn anomaly detection off for training; enable it only to chase a NaN.",
                    config={"torch.autograd.set_detect_anomaly": False}, edits=edits),
        )
