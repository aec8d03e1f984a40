"""step-slowdown: step time grows over the run (a trend, not noise)."""
from __future__ import annotations

from typing import Any, Iterable

from auditor.evidence import model as m
from auditor.rules.base import Cost, Finding, Fix, Location, Option, Rule, share_of_step, step_basis_ms
from auditor.rules.common import (
    on_accelerator,
    quarter_floors,
    quarter_medians,
    spearman,
    theil_sen,
    trend_ratio,
    without_spikes,
)


class StepSlowdown(Rule):
    """
    What it detects:
        Step time that keeps rising over the run: the last quarter of steps is much slower than the
        first, and the rise is a steady trend (rank correlation with the step index; on a CPU run,
        of the process's own CPU time, which other processes' load scatters less), not a few
        outliers: isolated spikes (a step above median + 6 MADs: a garbage collection, an epoch
        boundary) are left out, and the robust Theil-Sen line through the rest must rise by the
        same ratio. Warm-up steps and the profiled window are left out too. Load from other processes
        comes in bursts that lift whole stretches of the run and then leave; it adds time to steps but
        never makes the fastest step of a stretch slow, so the fastest step of the last quarter must
        also be slower than the fastest of the first by the same ratio (of wall time and, on a CPU run,
        of CPU time: with more than one intra-op thread, threads that wait for a descheduled peer
        spin and bill CPU time, so under load CPU time wanders with wall time). It names the probed
        call (backward, a sync, data loading...) whose own time grew the most.

    Why it costs:
        Something accumulates per step: a graph kept alive and backpropagated again, a growing
        Python list scanned every step, a cache that never hits. Left alone it gets worse with every
        epoch ("training slows down after the first batch").

    Example:
        bad:   hidden = rnn(x, hidden); loss.backward(retain_graph=True)  # backprop through all history
        good:  hidden = rnn(x, hidden.detach()); loss.backward()

    Fix:
        Follow the growing phase named in the finding; see graph-leak and memory-growth findings.

    Evidence needed:
        Per-step wall times from a run (at least `min-steps` unprofiled steps once isolated spikes
        are left out); on a CPU run the step's CPU time must show the same trend, so load from other
        processes is not mistaken for a slowdown.
    """

    id = "step-slowdown"
    title = "Steps get slower as the run goes on"
    severity = "warning"
    category = "performance"
    options = (
        Option("skip", 2, "Warm-up steps left out at the start."),
        Option("min-steps", 12, "Unprofiled steps needed to judge a trend (quarters of 3 or more)."),
        Option("min-ratio", 1.3, "Last-quarter median over first-quarter median to flag."),
        Option("min-correlation", 0.6, "Spearman correlation of step time with step index to flag."),
    )

    def skip_reason(self, ev: m.Evidence) -> str | None:
        return None if ev.source == "run" else "needs per-step times from a run"

    def check(self, ev: m.Evidence, options: dict[str, Any]) -> Iterable[Finding]:
        steps = [s for s in ev.steps if not s.profiled and s.index >= options["skip"]]
        steps = [steps[i] for i in without_spikes([s.ms for s in steps])]
        # counted after the spikes are out: the quarters the trend is judged on are of these steps
        if len(steps) < options["min-steps"]:
            return
        xs = [float(s.index) for s in steps]
        ys = [s.ms for s in steps]
        first, last = quarter_medians(ys)
        floor_first, floor_last = quarter_floors(ys)
        rho = spearman(xs, ys)
        w_trend = trend_ratio(xs, ys)
        if first <= 0 or w_trend < options["min-ratio"]:  # the robust line of wall time must rise
            return
        if floor_first <= 0 or floor_last / floor_first < options["min-ratio"]:
            return  # the fastest late steps are as fast as the early ones: load came and went
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
            if (c_first <= 0 or c_last / c_first < options["min-ratio"]
                    or c_floor_first <= 0 or c_floor_last / c_floor_first < options["min-ratio"]
                    or c_rho < options["min-correlation"] or trend_ratio(xs, cpu) < options["min-ratio"]):
                return
            judged = {"cpu_first_quarter_median_ms": round(c_first, 3), "cpu_last_quarter_median_ms": round(c_last, 3),
                      "cpu_ratio": round(c_last / c_first, 3), "cpu_spearman": round(c_rho, 3),
                      "cpu_fastest_ratio": round(c_floor_last / c_floor_first, 3)}
        elif last / first < options["min-ratio"] or rho < options["min-correlation"]:
            return
        else:
            judged = {}
        slope = theil_sen(xs, ys)
        culprit = self._culprit(steps)
        locs = [Location.of(culprit["where"])] if culprit and culprit["where"] else []
        blame = (f"; {culprit['what']} grew the most (+{culprit['growth_ms']:.1f} ms)" if culprit else "")
        if judged:
            head = (f"Step time rose x{w_trend:.2f} along its trend line (+{slope:.2f} ms per step); the step's own "
                    f"CPU time rose from {judged['cpu_first_quarter_median_ms']:.1f} ms to "
                    f"{judged['cpu_last_quarter_median_ms']:.1f} ms (x{judged['cpu_ratio']:.2f}, rank correlation "
                    f"{judged['cpu_spearman']:.2f})")
        else:
            head = (f"Step time rose from {first:.1f} ms to {last:.1f} ms (x{last / first:.2f}, "
                    f"+{slope:.2f} ms per step, rank correlation {rho:.2f})")
        # What the data shows, never more: the rise of the quarters' medians (or, when load lifted
        # the first quarter's above the last's, of their fastest steps), at most what the trend line
        # spans. A line through a series that wandered up and back spans more than any step rose.
        shown = last - first if last > first else floor_last - floor_first
        rise = max(0.0, min(slope * (xs[-1] - xs[0]), shown))
        # The share is of the run's median step, the basis of every other rule's share and of the
        # headline's: a share of the (slower) last quarter read beside them as a different number
        # for the same time. That comparison stays in the evidence, named as such.
        median_ms = step_basis_ms(ev)
        rise = round(rise, 3)
        yield self.finding(
            f"{head} over {len(steps)} steps{blame}.",
            locations=locs,
            evidence={"first_quarter_median_ms": round(first, 3), "last_quarter_median_ms": round(last, 3),
                      "ratio": round(last / first, 3), "trend_ratio": round(w_trend, 3),
                      "first_quarter_fastest_ms": round(floor_first, 3),
                      "last_quarter_fastest_ms": round(floor_last, 3),
                      "slope_ms_per_step": round(slope, 4),
                      "spearman": round(rho, 3), **judged, "steps_used": len(steps),
                      "median_step_ms": round(median_ms, 3) if median_ms else None,
                      "rise_share_of_last_quarter_step": round(min(1.0, rise / max(last, rise)), 4),
                      "growing_phase": {k: v for k, v in (culprit or {}).items() if k != "where"} or None},
            cost=Cost(ms_per_step=rise, share_of_step=share_of_step(rise, median_ms),
                      measured=True, note="extra time per step at the end of the run vs its start, "
                                          "as a share of the run's median step"),
            fix=Fix(summary="Find what accumulates per step (see the growing phase and graph-leak / "
                            "memory-growth findings) and stop keeping it."),
        )

    def _culprit(self, steps: list[m.StepRecord]) -> dict[str, Any] | None:
        """The probed call site whose own per-step time grew the most from first to last quarter."""
        series: dict[tuple, list[float]] = {}
        wheres: dict[tuple, tuple[str, m.Frame | None]] = {}
        for i, s in enumerate(steps):
            for t in s.tallies:
                key = (t.kind, t.what, t.where.file if t.where else None, t.where.line if t.where else None)
                series.setdefault(key, [0.0] * len(steps))[i] += t.ms
                wheres[key] = (t.what, t.where)
        best = None
        for key, ys in series.items():
            a, b = quarter_medians(ys)
            if best is None or b - a > best["growth_ms"]:
                best = {"what": wheres[key][0], "kind": key[0], "growth_ms": b - a, "where": wheres[key][1]}
        return best if best and best["growth_ms"] > 0 else None
