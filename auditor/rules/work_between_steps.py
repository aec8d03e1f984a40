"""work-between-steps: much of the run's time goes to work between its steps (an evaluation, a
checkpoint, logging), which the median step leaves out."""
from __future__ import annotations

import os
from typing import Iterable

from auditor.evidence import model as m
from auditor.evidence.between import Between, between
from auditor.evidence.run_time import RunTime, run_time
from auditor.findings import Cost, Finding, Fix, Location, share_of_step, step_basis_ms
from auditor.rules.base import Option, Options, Rule

# What to do about each kind of work between the steps (auditor.evidence.run_time.BETWEEN)
ADVICE = {
    "evaluation": "evaluate less often (every few hundred steps), on fewer batches, or under torch.inference_mode()",
    "checkpoints": "save less often, or in the background (a copy to the CPU written by a thread, or "
                   "torch.distributed.checkpoint.async_save)",
    "syncs": "read values to the host less often: keep them on the device and log every N steps",
    "other": "profile a stretch between the steps (torch.profiler around it) to see the work no probe times",
}


class WorkBetweenSteps(Rule):
    """
    What it detects:
        A whole program that spends `min-share` of the run's time or more between its steps (after
        one step's end, before the next one's start): an evaluation loop, a checkpoint save, values
        logged to the host, work the probes do not time. The run's time per step counts it
        (auditor.evidence.run_time), the median step does not. The time a DataLoader's new epoch
        takes there (its workers' stop and start) is worker-restarts', not this rule's. The
        message names what the probes timed in the stretches, per stretch, at the user's lines.
        One stretch in steps `--steps` cut short (an evaluation at iteration 0, then every 500) is
        said as an info with its time: how often it recurs, and so its cost a step, is not seen.

    Why it costs:
        Every stretch between the steps is time the training does not advance: an evaluation of
        16 batches every 4 steps can take more than the 4 steps.

    Example:
        for k, (x, y) in enumerate(train):
            train_step(x, y)
            if k % 4 == 3:
                evaluate(model, val)                           # 16 batches, every 4 steps
            if k % 8 == 7:
                torch.save(model.state_dict(), "model.pt")     # every 8 steps

    Fix:
        Do the work less often, on less data, or beside the training: evaluate every few hundred
        steps (or on a subset), save checkpoints less often or in the background, log values from
        the device every N steps. Its cost is the time the stretches take, measured: what doing
        that work less often gives back, at most.

    Evidence needed:
        A whole program's run (`audit run file.py`) whose audited steps have stretches between
        them; the probes' tallies there (forwards, fetches, syncs, torch.save).
    """

    id = "work-between-steps"
    title = "Work between the steps takes much of the run's time"
    severity = "warning"
    saves_on = "step"
    category = "performance"
    needs = frozenset({"run"})
    needs_text = "needs a whole program's run with stretches between its steps"
    options = (
        Option("min-share", 0.25, "Share of the run's time spent between the steps (a new epoch's DataLoader start "
                                  "left out) to flag."),
    )

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        account, stretches = run_time(ev), between(ev)
        if account is None or account.source != "run" or stretches is None:
            return
        pieces = {p.name: p for p in account.part("between").what if p.name != "epoch starts" and p.ms > 0}
        ms = round(sum(p.per_step_ms for p in pieces.values()), 3)
        share = share_of_step(ms, step_basis_ms(ev)) or 0.0
        if share < options.min_share:
            return
        if stretches.stretches == 1 and stretches.after_steps and ev.program is not None and ev.program.ended_by_audit:
            yield self._once(stretches, pieces, share, len(ev.steps))
            return
        yield self._finding(account, stretches, pieces, ms, share)

    def _once(self, b: Between, pieces: dict, share: float, steps: int) -> Finding:
        """One stretch in steps that --steps cut short (nanoGPT's and minGPT's evaluation at
        iteration 0): how often it comes back is not seen, so its time is not a cost per step."""
        seconds = f"{b.ms / 1000:.2f} s"
        after = b.after_steps[0]
        message = (f"Work after step {after} of {steps}: how often it recurs is not seen. It ran once between the "
                   f"audited steps and took {seconds} ({share:.0%} of the audited run's time): what it costs a step "
                   "is that over the steps from one stretch to the next." + _in_each(b, "it"))
        kinds = sorted(pieces.values(), key=lambda p: -p.ms)
        advice = "; ".join(f"{p.name}: {ADVICE[p.name]}" for p in kinds if p.name in ADVICE and p.ms >= 0.1 * sum(
            q.ms for q in kinds))
        return self.finding(
            message, severity="info", locations=_locations(b),
            evidence={"once_ms": b.ms, "stretches": 1, "after_steps": b.after_steps, "audited_steps": steps,
                      "by_kind_ms_per_step": {p.name: p.per_step_ms for p in kinds}},
            cost=Cost(ms_per_step=None, share_of_step=None, measured=True, note=f"{seconds} once"),
            fix=Fix(summary=f"Audit past its next stretch (a larger --steps) to measure its cost a step; where it "
                            f"recurs often: {advice}."))

    def _finding(self, account: RunTime, b: Between, pieces: dict, ms: float, share: float) -> Finding:
        after = ", ".join(map(str, b.after_steps[:6])) + (", ..." if len(b.after_steps) > 6 else "")
        apart = f", {b.steps_per_stretch:g} steps apart" if b.steps_per_stretch else ""
        kinds = sorted(pieces.values(), key=lambda p: -p.ms)
        parts = ", ".join(f"{p.name} {p.per_step_ms:.2f}" for p in kinds)
        message = ("Work between the steps takes time: do it less often. "
                   f"{ms:.2f} ms a step ({share:.0%} of the run's time) runs between the steps, in {b.stretches} "
                   f"stretch{'es' if b.stretches > 1 else ''} (after step{'s' if b.stretches > 1 else ''} {after}"
                   f"{apart}): {parts} ms a step.")
        message += _in_each(b, "each")
        advice = "; ".join(f"{p.name}: {ADVICE[p.name]}" for p in kinds if p.name in ADVICE and p.ms >= 0.1 * sum(
            q.ms for q in kinds))
        return self.finding(
            message, locations=_locations(b),
            evidence={"ms_per_step": ms, "stretches": b.stretches, "after_steps": b.after_steps,
                      "steps_per_stretch": b.steps_per_stretch, "median_stretch_ms": b.median_ms,
                      "by_kind_ms_per_step": {p.name: p.per_step_ms for p in kinds}},
            cost=Cost(ms_per_step=ms, share_of_step=share, measured=True,
                      note="the stretches between the steps, measured: what doing their work less often gives back, at most"),
            fix=Fix(summary=f"Do this work less often or beside the training: {advice}."))


def _in_each(b: Between, each: str) -> str:
    """What the probes timed in the stretches, at the user's lines (" In each: ...")."""
    if not b.work:
        return ""
    return f" In {each}: " + "; ".join(
        f"{w.kind} x{w.count:g} at {os.path.basename(w.file) + ' ' if w.file else ''}"
        + (f"line{'s' if len(w.lines) > 1 else ''} {', '.join(map(str, w.lines))}" if w.lines else "no known line")
        + f" ({w.ms:.1f} ms)" for w in b.work[:3]) + "."


def _locations(b: Between) -> list[Location]:
    return list(dict.fromkeys(Location(w.file, w.lines[0]) for w in b.work if w.file and w.lines))[:3]
