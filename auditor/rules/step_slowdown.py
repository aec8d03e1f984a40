"""step-slowdown: step time grows over the run (a trend, not noise)."""
from __future__ import annotations

from statistics import fmean, median
from typing import Any, Iterable

import msgspec

from auditor.evidence import model as m
from auditor.evidence.frame import Frame
from auditor.evidence.loops import loops
from auditor.rules.base import Option, Options, Rule
from auditor.findings import Cost, Finding, Fix, Location, share_of_step, step_basis_ms
from auditor.rules._support.confidence import cpu_over_wall, trend_confidence
from auditor.rules._support.hooks import hook_phase, piling_hooks
from auditor.rules._support.places import on_accelerator
from auditor.rules._support.text import file_name
from auditor.rules._support.trends import quarter_floors, quarter_medians, spearman, theil_sen, trend_ratio, without_spikes


def rise_of(xs: list[float], ys: list[float]) -> float:
    """How much more time the last steps took than the first, as the data shows it, never more:
    the rise of the quarters' medians (or, when load lifted the first quarter's above the last's,
    of their fastest steps), at most what the Theil-Sen line spans (a line through a series that
    wandered up and back spans more than any step rose). The step's rise and the growing call's
    are both this: the two numbers a message prints side by side are on one basis."""
    first, last = quarter_medians(ys)
    floor_first, floor_last = quarter_floors(ys)
    shown = last - first if last > first else floor_last - floor_first
    return max(0.0, min(theil_sen(xs, ys) * (xs[-1] - xs[0]), shown))


def last_loop(steps: list[m.StepRecord]) -> tuple[list[m.StepRecord], int]:
    """The steps of the loop the run ended in, and how many loops ran before it
    (auditor.evidence.loops): a program that trains one model and then another (pytorch/tutorials'
    nn_tutorial: a logistic regression, then CNNs, each in a loop of its own) has steps of
    different work, and a rise across them is no slowdown."""
    parts = loops(steps)
    return parts[-1], len(parts) - 1

class _Trend(msgspec.Struct):
    """A rise the rule judged, and the numbers it was judged on."""
    steps: list[m.StepRecord]
    before: int  # training loops before the one judged
    xs: list[float]
    first: float
    last: float
    floor_first: float
    floor_last: float
    rho: float
    w_trend: float
    load: tuple[float, float] | None
    load_rose: bool
    need: float
    judged: dict[str, Any]  # a CPU run's verdict, on its CPU time ({} on an accelerator)
    slope: float
    rise: float
    saved: float  # what a step of this run took above the first quarter's level, on average
    per_cpu_ms: float | None
    confidence: dict[str, Any]
    confidence_text: str


class StepSlowdown(Rule):
    """
    What it detects:
        Step time that keeps rising over the run: the last quarter of steps is much slower than the
        first, and the rise is a steady trend (rank correlation with the step index; on a CPU run,
        of the process's own CPU time), not a few outliers: spikes above median + 6 MADs (a garbage
        collection, an epoch boundary), warm-up steps and the profiled window are left out, and the
        Theil-Sen line through the rest must rise by the same ratio. Load from other processes
        lifts whole stretches of the run but never makes the fastest step of a stretch slow, so the
        fastest step of the last quarter must also be slower than the first quarter's. Where the
        kernel measures that the step's thread waited for the CPU more in the last quarter (by
        `max-load-rise`), the rise must be `load-slowdown` times larger. It names the probed call
        (backward, a sync, data loading...) whose own time grew the most, and first a line whose
        hooks pile up every step (see hook-leak).

    Why it costs:
        Something accumulates per step: a graph kept alive and backpropagated again, a growing
        Python list scanned every step, a cache that never hits. Left alone it gets worse with every
        epoch ("training slows down after the first batch").

    Example:
        bad:   hidden = rnn(x, hidden); loss.backward(retain_graph=True)  # backprop through all history
        good:  hidden = rnn(x, hidden.detach()); loss.backward()

    Fix:
        Follow the growing phase named in the finding; see graph-leak and memory-growth findings.
        The finding states its confidence: the spread of the first and last quarters of the steps
        and the rise against the steps' scatter about the trend line.

    Evidence needed:
        Per-step wall times from a run (at least `min-steps` unprofiled steps once spikes are left
        out), of the loop the run ended in (a program that trains in several loops is judged on
        its last). On a CPU run the step's CPU time must show the same trend, and the cost is that
        CPU time's rise, at the run's wall time per CPU ms.
    """

    id = "step-slowdown"
    saves_on = "step"
    title = "Steps get slower as the run goes on"
    severity = "warning"
    category = "performance"
    needs = frozenset({"run"})
    needs_text = "needs per-step times from a run"
    options = (
        Option("skip", 2, "Warm-up steps left out at the start."),
        Option("min-steps", 12, "Unprofiled steps needed to judge a trend (quarters of 3 or more)."),
        Option("min-ratio", 1.3, "Last-quarter median over first-quarter median to flag."),
        Option("min-correlation", 0.6, "Spearman correlation of step time with step index to flag."),
        Option("max-load-rise", 0.1, "Rise, from the first quarter to the last, in the share of the step its thread "
                                     "waited for a CPU that other processes held, above which load rose with the steps.", high=1.0),
        Option("load-slowdown", 2.0, "Where load rose with the steps (max-load-rise): how many times min-ratio the "
                                     "step's own time must rise, beyond what such load makes of constant work.", low=1.0),
    )

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        t = self._trend(ev, options)
        if t is None:
            return
        steps, xs, first, last, rise, judged, before = t.steps, t.xs, t.first, t.last, t.rise, t.judged, t.before
        slope, rho, w_trend, load = t.slope, t.rho, t.w_trend, t.load
        culprit = self._culprit(steps, xs)
        locs, blame = self._blame(culprit, rise, steps)
        head = self._head(t)
        # What piles up, when the probes saw it: hooks added to the same tensors every step run in
        # the backward pass, which is where the time grows, not at the line that adds them.
        piles = piling_hooks(ev)
        for p in piles[:2]:
            if p.where is None:
                continue
            holders = "tensor" if p.what.startswith("Tensor.") else "module"
            blame += (f" Hooks pile up at {file_name(p.where.file)}:{p.where.line}: {p.what} adds them to the same "
                      f"{p.holders} {holders}{'' if p.holders == 1 else 's'} every step ({p.first[1]} each after step {p.first[0]}, "
                      f"{p.last[1]} after step {p.last[0]}), and every {hook_phase(p.what)} pass runs them all "
                      "(see hook-leak).")
        hook_locs = [Location.of(p.where) for p in piles[:2] if p.where is not None]
        locs = hook_locs + [x for x in locs if (x.file, x.line) not in {(h.file, h.line) for h in hook_locs}]
        # The share is of the run's time per step, the basis of every other rule's share and of the
        # headline's: a share of the (slower) last quarter read beside them as a different number
        # for the same time. That comparison stays in the evidence, named as such.
        median_ms = step_basis_ms(ev)
        yield self.finding(
            f"Steps get slower as the run goes on: find what builds up. {head}{blame} {t.confidence_text}",
            locations=locs,
            evidence={"first_quarter_median_ms": round(first, 3), "last_quarter_median_ms": round(last, 3),
                      "rise_ms": rise,
                      "ratio": round(last / first, 3), "trend_ratio": round(w_trend, 3),
                      "first_quarter_fastest_ms": round(t.floor_first, 3),
                      "last_quarter_fastest_ms": round(t.floor_last, 3),
                      "slope_ms_per_step": round(slope, 4),
                      "spearman": round(rho, 3), **judged, "steps_used": len(steps), **t.confidence,
                      "loops_before": before, "first_step_judged": steps[0].index,
                      "waited_share_first_quarter": round(load[0], 4) if load else None,
                      "waited_share_last_quarter": round(load[1], 4) if load else None,
                      "load_rose": t.load_rose, "ratio_needed": round(t.need, 3),
                      "run_step_ms": round(median_ms, 3) if median_ms else None,
                      "rise_share_of_last_quarter_step": round(min(1.0, rise / max(last, rise)), 4),
                      "growing_phase": {**{k: v for k, v in culprit.items() if k != "where"},
                                        "file": culprit["where"].file if culprit["where"] else None,
                                        "line": culprit["where"].line if culprit["where"] else None}
                      if culprit else None,
                      "piling_hooks": [{"what": p.what, "line": p.where.line if p.where else None,
                                        "holders": p.holders, "held_first": p.first[1], "held_last": p.last[1]}
                                       for p in piles[:2]]},
            cost=Cost(ms_per_step=t.saved, share_of_step=share_of_step(t.saved, median_ms),
                      measured=True, note="what the run's steps took above its first quarter's, on average (its last "
                                          f"steps {rise:.2f} ms more)"
                                          + (" (the process's CPU time, at the run's wall time per CPU ms)"
                                             if judged else "") + ", as a share of the run's time per step"),
            fix=Fix(summary=("Register the hooks once, at setup, or remove them (handle.remove()) when done; "
                             if piles else "")
                    + "Find what accumulates per step (see the growing phase and graph-leak / "
                      "memory-growth findings) and stop keeping it."),
        )

    def _trend(self, ev: m.Evidence, options: Options) -> _Trend | None:
        """The steps' rise where it passes every gate of the verdict (else None), and how sure it is."""
        steps = [s for s in ev.steps if not s.profiled and s.index >= options.skip]
        steps, before = last_loop(steps)
        steps = [steps[i] for i in without_spikes([s.ms for s in steps])]
        # counted after the spikes are out: the quarters the trend is judged on are of these steps
        if len(steps) < options.min_steps:
            return
        xs = [float(s.index) for s in steps]
        ys = [s.ms for s in steps]
        first, last = quarter_medians(ys)
        floor_first, floor_last = quarter_floors(ys)
        rho = spearman(xs, ys)
        w_trend = trend_ratio(xs, ys)
        if first <= 0 or w_trend < options.min_ratio:  # the robust line of wall time must rise
            return
        if floor_first <= 0 or floor_last / floor_first < options.min_ratio:
            return  # the fastest late steps are as fast as the early ones: load came and went
        # Load from other processes that rose as the steps slowed: the step's thread waited for a CPU
        # (Linux's run delay) for a larger share of the last steps than of the first. Such load also
        # slows the process's own instructions where it shares a core's caches or its SMT sibling
        # (by up to ~2x: x1.48 in the CPU time of a CI run's constant steps), so the step's own time
        # must rise by `load-slowdown` times more than otherwise for the rise to be its work's.
        waited = ([s.waited_ms / s.ms for s in steps] if all(s.waited_ms is not None and s.ms > 0 for s in steps)
                  else None)
        load = quarter_medians(waited) if waited else None
        load_rose = bool(load and load[1] - load[0] > options.max_load_rise)
        need = options.min_ratio * (options.load_slowdown if load_rose else 1.0)
        if not on_accelerator(ev) and all(s.cpu_ms is not None for s in steps):
            # On the CPU the work itself must grow too: wall time alone also rises when other
            # processes load the machine. That load inflates whole stretches of wall time (a
            # first quarter, a burst mid-run), so the ratio and steadiness are judged on this
            # process's own CPU time; of wall time only its Theil-Sen line and its fastest steps,
            # robust to such stretches, must rise. CPU time is no proof against load on its own: with two or more
            # intra-op threads, one waiting at a barrier for a descheduled peer spins, and that
            # spin is billed as CPU time, so its fastest steps must rise too.
            cpu = [s.cpu_ms for s in steps]
            c_first, c_last = quarter_medians(cpu)
            c_floor_first, c_floor_last = quarter_floors(cpu)
            c_rho = spearman(xs, cpu)
            if (c_first <= 0 or c_last / c_first < need
                    or c_floor_first <= 0 or c_floor_last / c_floor_first < need
                    or c_rho < options.min_correlation or trend_ratio(xs, cpu) < need):
                return
            judged = {"cpu_first_quarter_median_ms": round(c_first, 3), "cpu_last_quarter_median_ms": round(c_last, 3),
                      "cpu_ratio": round(c_last / c_first, 3), "cpu_spearman": round(c_rho, 3),
                      "cpu_fastest_ratio": round(c_floor_last / c_floor_first, 3)}
        elif (last / first < need or floor_last / floor_first < need or w_trend < need
              or rho < options.min_correlation):
            return
        else:
            judged = {}
        slope = theil_sen(xs, ys)
        wall_rise_ms = rise_of(xs, ys)
        wall_rise = round(wall_rise_ms, 3)
        rise, per_cpu_ms = wall_rise, None
        # How sure: judged on the series the verdict was (CPU time on a CPU run, which other load
        # scatters less), its first and last quarters' spread and its rise against the steps'
        # scatter about its trend line.
        basis, b_slope, b_rise, b_first, b_last = ys, slope, wall_rise_ms, first, last
        if judged:
            # On a CPU run the rise is the process's own CPU time's, in wall time at the run's wall
            # time per CPU ms (the factor other load stretched every step by, the median step's
            # too): load that came in bursts lifted the wall rise of one run 10 times another's.
            per_cpu_ms = median(s.ms / s.cpu_ms for s in steps if s.cpu_ms)
            cpu_rise = rise_of(xs, cpu)
            rise = round(cpu_rise * per_cpu_ms, 3)
            judged.update(cpu_rise_ms=round(cpu_rise, 3), wall_per_cpu_ms=round(per_cpu_ms, 3),
                          wall_rise_ms=wall_rise)
            basis, b_slope, b_rise, b_first, b_last = cpu, theil_sen(xs, cpu), cpu_rise, c_first, c_last
        # A fix saves every step's time above the first quarter's level: the run's mean excess,
        # about half the end's rise for a steady one (never more than that rise).
        saved = round(min(rise, max(0.0, fmean(basis) - b_first) * (per_cpu_ms or 1.0)), 3)
        b_icept = sorted(y - b_slope * x for x, y in zip(xs, basis))[len(basis) // 2]
        confidence, confidence_text = trend_confidence(
            basis, [b_icept + b_slope * x for x in xs], b_rise, options.min_ratio,
            b_last / b_first if b_first > 0 else 0.0, "CPU" if judged else "wall", cpu_over_wall(steps))
        return _Trend(steps=steps, before=before, xs=xs, first=first, last=last, floor_first=floor_first,
                      floor_last=floor_last, rho=rho, w_trend=w_trend, load=load, load_rose=load_rose, need=need,
                      judged=judged, slope=slope, rise=rise, saved=saved, per_cpu_ms=per_cpu_ms, confidence=confidence,
                      confidence_text=confidence_text)

    def _blame(self, culprit: dict[str, Any] | None, rise: float,
               steps: list[m.StepRecord]) -> tuple[list[Location], str]:
        """Where the message places the rise: the probed call or line that grew the most."""
        locs = [Location.of(culprit["where"])] if culprit and culprit["where"] else []
        if culprit:
            at = f" at {file_name(culprit['where'].file)}:{culprit['where'].line}" if culprit["where"] else ""
            g = culprit["growth_ms"]  # (the rest of the step may have got faster: at most all of the rise)
            w = culprit["where"]
            what = (f"The time spent at line {w.line} of {file_name(w.file)}"
                    + (f" (`{w.code}`)" if w.code else "") if culprit["kind"] == m.LINE_TIME and w else culprit["what"] + at)
            sampled = culprit.get("sampled_steps")
            over = (f" (read over the {sampled} of {len(steps)} steps the line sampler looked at)"
                    if sampled is not None and sampled < len(steps) else "")
            blame = (f" {what} grew the most{over}: "
                     + (f"all of those {rise:.2f} ms." if g >= rise else f"{g:.2f} ms of those {rise:.2f} ms.")
                     + (f" The probed calls (forward, backward, optimizer, data) grew by at most "
                        f"{culprit.get('phase_growth_ms', 0.0):.2f} ms ({culprit.get('what_grew') or 'none'}): the "
                        "growth is this line's own." if culprit["kind"] == m.LINE_TIME else ""))
        else:
            blame = ""
        return locs, blame

    def _head(self, t: _Trend) -> str:
        """The message's opening: how the step time rose, over which steps."""
        judged, first, last, slope, rho, w_trend, steps = t.judged, t.first, t.last, t.slope, t.rho, t.w_trend, t.steps
        before, rise, per_cpu_ms = t.before, t.rise, t.per_cpu_ms
        if judged:
            head = (f"Step time rose x{w_trend:.2f} along its trend line (+{slope:.3g} ms with each step); the step's own "
                    f"CPU time rose from {judged['cpu_first_quarter_median_ms']:.1f} ms to "
                    f"{judged['cpu_last_quarter_median_ms']:.1f} ms (x{judged['cpu_ratio']:.2f}, rank correlation "
                    f"{judged['cpu_spearman']:.2f})")
        else:
            head = (f"Step time rose from {first:.1f} ms to {last:.1f} ms (x{last / first:.2f}, "
                    f"+{slope:.3g} ms with each step, rank correlation {rho:.2f})")
        head += f" over {len(steps)} steps" + (f" (those of the last of its {before + 1} training loops, from step "
                                                f"{steps[0].index})" if before else "")
        head += f": the last steps took {rise:.2f} ms more than the first"
        head += (f" ({judged['cpu_rise_ms']:.2f} ms more CPU time, at this run's {per_cpu_ms:.2f} ms of wall "
                 "time per ms of CPU time)." if judged else ".")
        return head


    def _culprit(self, steps: list[m.StepRecord], xs: list[float]) -> dict[str, Any] | None:
        """The probed call site whose own per-step time grew the most, measured as the step's rise
        is (rise_of): a difference of quarter medians said the backward grew by 12.0 ms in a step
        whose stated rise was 8.56 ms. It may still exceed the step's rise when the rest of the
        step got faster; the message then says it grew by all of it."""
        series: dict[tuple, list[float]] = {}
        wheres: dict[tuple, tuple[str, Frame | None]] = {}
        for i, s in enumerate(steps):
            for t in s.tallies:
                key = (t.kind, t.what, t.where.file if t.where else None, t.where.line if t.where else None)
                series.setdefault(key, [0.0] * len(steps))[i] += t.ms
                wheres[key] = (t.what, t.where)
        # a line's time is known in the steps the line sampler looked at (after the dense start, one
        # in 16, fewer in a long run: auditor.capture.lines), and its rise is read over those
        sampled = [i for i, s in enumerate(steps) if s.lines_sampled]
        line_xs = [xs[i] for i in sampled]
        best = phase = None
        for key, ys in series.items():
            if key[0] == m.LINE_TIME:
                if len(sampled) < 4:
                    continue
                growth = rise_of(line_xs, [ys[i] for i in sampled])
            else:
                growth = rise_of(xs, ys)
            if best is None or growth > best["growth_ms"]:
                best = {"what": wheres[key][0], "kind": key[0], "growth_ms": growth, "where": wheres[key][1]}
            if key[0] != m.LINE_TIME and (phase is None or growth > phase["growth_ms"]):
                phase = {"what": wheres[key][0], "kind": key[0], "growth_ms": growth, "where": wheres[key][1]}
        if best is not None and best["kind"] == m.LINE_TIME and phase is not None and phase["where"] is not None \
                and best["where"] is not None and (phase["where"].file, phase["where"].line) == \
                (best["where"].file, best["where"].line) and phase["growth_ms"] >= 0.5 * best["growth_ms"]:
            best = phase  # the line grew by the probed call made there (a forward): that call is named
        if not best or best["growth_ms"] <= 0:
            return None
        best["growth_ms"] = round(best["growth_ms"], 3)
        if best["kind"] == m.LINE_TIME:  # what the line's rise is read over
            best["sampled_steps"] = len(sampled)
        if best["kind"] == m.LINE_TIME and phase is not None and phase["growth_ms"] > 0:
            # the probed call that grew the most, beside the line that grew more outside it
            best["what_grew"], best["phase_growth_ms"] = phase["what"], round(phase["growth_ms"], 3)
        return best
