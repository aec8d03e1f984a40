"""memory-growth: memory at step boundaries keeps rising."""
from __future__ import annotations

from typing import Any, Iterable

from auditor.evidence import model as m
from auditor.rules.base import Finding, Fix, Location, Option, Rule
from auditor.rules.common import spearman, theil_sen

MiB = 2**20


class MemoryGrowth(Rule):
    """
    What it detects:
        Memory measured at step boundaries (CUDA allocated bytes on a GPU; process RSS on the CPU)
        that rises steadily through the run, after warm-up and the profiled window.

    Why it costs:
        Memory that grows every step ends in an out-of-memory error, often hours in ("OOM after
        several episodes, all progress lost"). Typical causes: per-step outputs kept in a list,
        tensors cached in a dict that never evicts, graphs kept alive (see graph-leak).

    Example:
        bad:   all_logits.append(logits.detach())        # every step, never cleared
        good:  metric.update(logits); keep only the summary, or move to CPU and subsample

    Fix:
        Keep summaries instead of tensors, clear per-epoch buffers, detach and move to CPU what
        you must keep.

    Evidence needed:
        Memory at step boundaries from a run (at least `min-steps` steps after warm-up).
    """

    id = "memory-growth"
    title = "Memory keeps growing from step to step"
    severity = "warning"
    category = "memory"
    options = (
        Option("skip", 2, "Warm-up steps left out at the start."),
        Option("min-steps", 8, "Step boundaries needed to judge a trend."),
        Option("min-growth-mib", 32.0, "Total growth over the steps used, in MiB, to flag."),
        Option("min-mib-per-step", 0.25, "Robust growth rate, MiB per step, to flag."),
        Option("min-correlation", 0.8, "Spearman correlation of memory with step index to flag."),
    )

    def skip_reason(self, ev: m.Evidence) -> str | None:
        return None if ev.source == "run" else "needs memory at step boundaries from a run"

    def check(self, ev: m.Evidence, options: dict[str, Any]) -> Iterable[Finding]:
        device = any(s.device_allocated is not None for s in ev.steps)
        metric = "device_allocated" if device else "rss_bytes"
        window_end = max(ev.profile.steps) if ev.profile and ev.profile.steps else -1
        steps = [s for s in ev.steps if s.index >= options["skip"] and getattr(s, metric) is not None]
        after = [s for s in steps if s.index > window_end]
        steps = after if len(after) >= options["min-steps"] else [s for s in steps if not s.profiled]
        if len(steps) < options["min-steps"]:
            return
        xs = [float(s.index) for s in steps]
        ys = [getattr(s, metric) / MiB for s in steps]
        growth = ys[-1] - ys[0]
        slope = theil_sen(xs, ys)
        rho = spearman(xs, ys)
        if growth < options["min-growth-mib"] or slope < options["min-mib-per-step"] or rho < options["min-correlation"]:
            return
        holders = []
        for scan in ev.graph_scans[-1:]:
            holders = [h for h in scan.holders if h.get("where")]
        locs = [Location(file=h["where"]["file"], line=h["where"]["line"], code=h["where"].get("code", ""))
                for h in holders]
        what = "CUDA allocated memory" if device else "Process memory (RSS)"
        yield self.finding(
            f"{what} grew by {growth:.0f} MiB over steps {steps[0].index}-{steps[-1].index} "
            f"({slope:.2f} MiB per step, rank correlation {rho:.2f}); at this rate another 1,000 steps "
            f"add {slope * 1000 / 1024:.1f} GiB.",
            locations=locs,
            evidence={"metric": metric, "start_mib": round(ys[0], 1), "end_mib": round(ys[-1], 1),
                      "growth_mib": round(growth, 1), "mib_per_step": round(slope, 3), "spearman": round(rho, 3),
                      "steps_used": len(steps)},
            cost=None,
            fix=Fix(summary="Stop keeping per-step tensors: keep summaries, clear buffers, detach and move to CPU."),
        )
