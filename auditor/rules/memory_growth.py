"""memory-growth: memory at step boundaries keeps rising."""
from __future__ import annotations

import os
from typing import Any, Iterable

from auditor.evidence import model as m
from auditor.evidence.allocator.growth import LineGrowth, growing_lines
from auditor.evidence.snapshot import format_bytes
from auditor.rules.base import Option, Options, Rule
from auditor.findings import Finding, Fix, Location
from auditor.rules._support.holders import holder_key, holder_label
from auditor.rules._support.scans import spread_scans
from auditor.rules._support.trends import spearman, theil_sen
from auditor.evidence import source_access

MiB = 2**20


def _judged_steps(ev: m.Evidence, metric: str, options: Options) -> list[m.StepRecord]:
    """The steps whose memory the trend is read on: after the profiler's window where enough are."""
    # The profiler's buffers come and go around its window: judge the steps after it settles.
    settle = max(ev.profile.steps) + 2 if ev.profile and ev.profile.steps else -1
    steps = [s for s in ev.steps if s.index >= options.skip and getattr(s, metric) is not None]
    after = [s for s in steps if s.index > settle]
    if len(after) >= options.min_steps:
        steps = after
    elif metric == "rss_bytes" and settle >= 0:
        # too few steps after the window: those before it. Process memory across the window holds
        # what the profiler left in the heap (llm.c's train_gpt2, 12 steps: +300 MiB over the
        # window, read as 47 MiB a step of growth where the plain run stays flat)
        steps = [s for s in steps if s.index < min(ev.profile.steps)]
    else:
        steps = [s for s in steps if not s.profiled]
    return steps


def _growth_locations(ev: m.Evidence, holders: list[dict[str, Any]]) -> tuple[list[Location], str]:
    """The growing holders' lines; without one, the line whose recorded allocations grew."""
    locs = [Location(file=h["where"]["file"], line=h["where"]["line"], code=h["where"].get("code", ""))
            for h in holders if h.get("where")]
    # no holder's line: the line whose allocations the recorded allocator history saw grow
    allocs, grown = ("", None) if locs else _growing_allocation(ev)
    if grown is not None:
        code = source_access.getline(grown.frame.filename, grown.frame.line).strip()
        locs = [Location(file=grown.frame.filename, line=grown.frame.line, code=code)]
    return locs, allocs


class MemoryGrowth(Rule):
    """
    What it detects:
        Memory measured at step boundaries (CUDA allocated bytes on a GPU; process RSS on the CPU)
        that rises steadily through the run, after warm-up and the profiled window; or tensors held
        by the target module's state (lists, dicts, globals, and the buffers and tensor attributes
        of its nn.Modules, named by module path: `model.1.queue`) whose bytes grew at every scan,
        with the line that grows them (`.append`, `x[key] = ...`, `+=`,
        `self.queue = torch.cat([self.queue, k])`). Those are counted exactly, so a few MiB of such
        growth is flagged where process memory would need far more to prove it; a buffer that
        fills to a cap and stays there is not (LBFGS's history: at most 2 x history_size + 3 flat
        parameter vectors). Holders are also a running function's locals (`total`, a local of
        `train()`) and the variables the user's closures keep (a hook's list). With no holder's
        line, the finding is located at the line whose allocations a recorded allocator history
        saw stay alive and grow at every step's end. In a CUDA rehearsal with `--device-memory`,
        the steps' memory is the rehearsed device's (the requests the rehearsal recorded).

    Why it costs:
        Memory that grows every step ends in an out-of-memory error, often hours in ("OOM after
        several episodes, all progress lost"). Typical causes: per-step outputs kept in a list,
        tensors cached in a dict that never evicts, a queue kept as a module buffer and never
        trimmed, graphs kept alive (see graph-leak).

    Example:
        bad:   all_logits.append(logits.detach())        # every step, never cleared
        good:  metric.update(logits); keep only the summary, or move to CPU and subsample

    Fix:
        Keep summaries instead of tensors, clear per-epoch buffers, detach and move to CPU what
        you must keep; where the holder is known, the fix names it and says what suits its kind
        (a list: a running result, or .cpu() copies every N steps; a dict: evict; a concatenated
        buffer: keep the last N rows). In CUDA rehearsal, growth held in tensors the program
        puts on the GPU is said to be the GPU's memory (the rehearsal keeps it in process memory).

    Evidence needed:
        Memory at step boundaries from a run (at least `min-steps` steps after warm-up).
    """

    id = "memory-growth"
    title = "Memory keeps growing from step to step"
    severity = "warning"
    category = "memory"
    needs = frozenset({"run"})
    needs_text = "needs memory at step boundaries from a run"
    options = (
        Option("skip", 2, "Warm-up steps left out at the start."),
        Option("min-steps", 8, "Step boundaries needed to judge a trend."),
        Option("min-growth-mib", 32.0, "Total growth over the steps used, in MiB, to flag."),
        Option("min-mib-per-step", 0.25, "Robust growth rate, MiB per step, to flag."),
        Option("min-correlation", 0.8, "Spearman correlation of memory with step index to flag."),
        Option("min-rss-growth-share", 0.1,
               "Process memory (RSS) only: the growth must also be at least this share of the first step "
               "used's, since a large heap's own churn moves it by tens of MiB between runs of the same "
               "program (device memory is counted exactly)."),
        Option("min-rss-steps", 30,
               "Process memory (RSS) only, where no holder explains it: a trend read on fewer steps is info, "
               "said to be unsure, since a heap and a DataLoader's batches in flight settle over tens of steps "
               "(pytorch/examples imagenet --dummy rose 240 MiB over steps 9-19 of a 20-step audit, then stayed "
               "flat to step 79)."),
        Option("min-held-growth-mib", 4.0, "Growth, in MiB, of the tensors one module-level name holds (a list, "
                                           "dict or global) that grew at every scan, to flag: counted exactly, "
                                           "so less growth than RSS needs is proof enough."),
    )

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        device = any(s.device_allocated is not None for s in ev.steps)
        metric = "device_allocated" if device else "rss_bytes"
        steps = _judged_steps(ev, metric, options)
        holders = self._growing_holders(ev)
        # A holder that a library caps (LBFGS's history) fills, then stays: its growth is no growth.
        # The trend it explains is none either: at most its cap in all.
        capped = [h for h in holders if h.get("bound_bytes") is not None and h["bytes"] <= h["bound_bytes"]]
        holders = [h for h in holders if h not in capped]
        capped_mib = sum(h["bound_bytes"] for h in capped) / MiB
        held_growth = sum(h["growth_bytes"] for h in holders) / MiB
        held_enough = held_growth >= options.min_held_growth_mib
        if len(steps) < options.min_steps and not held_enough:
            return
        xs = [float(s.index) for s in steps]
        ys = [getattr(s, metric) / MiB for s in steps]
        slope = theil_sen(xs, ys) if len(xs) >= 2 else 0.0
        growth = slope * (xs[-1] - xs[0]) if len(xs) >= 2 else 0.0
        rho = spearman(xs, ys)
        floor = options.min_rss_growth_share * ys[0] if metric == "rss_bytes" and ys else 0.0
        trend = (growth >= max(options.min_growth_mib, floor) and slope >= options.min_mib_per_step
                 and rho >= options.min_correlation)
        if capped and not holders and growth <= capped_mib:
            trend = False
        if not trend and not held_enough:
            return
        locs, allocs = _growth_locations(ev, holders)
        caps = "; ".join(f"`{h['name']}` is capped ({h['bound_why']}: at most {h['bound_bytes'] / MiB:.0f} MiB, "
                         f"{h['bytes'] / MiB:.0f} MiB now), not counted" for h in capped)
        # In CUDA rehearsal the program's GPU tensors live in process memory: growth they make is
        # the GPU's device memory on the machine the program is written for, not host RAM.
        on_gpu = {holder_key(h) for h in holders if 2 * h.get("device_growth_bytes", 0) >= h["growth_bytes"]}
        rehearsed_gpu = (not device and ev.environment.rehearsal and held_growth > 0
                         and sum(h["growth_bytes"] for h in holders if holder_key(h) in on_gpu)
                         >= 0.5 * held_growth * MiB)
        held = "; ".join(f"{holder_label(h)} grew by {h['growth_bytes'] / MiB:.0f} MiB"
                         + (" of GPU tensors" if rehearsed_gpu and holder_key(h) in on_gpu else "") for h in holders)
        what = ("Process memory (RSS)" if not device else "CUDA allocated memory" if not ev.environment.rehearsal
                else "GPU memory (the requests this CUDA rehearsal recorded for the tensors the program puts on the GPU)")
        if not trend:  # the memory is plainly held by module state, even if RSS is too noisy to show it
            scans = spread_scans(ev.graph_scans)
            span = max(1, scans[-1].after_step - scans[0].after_step)
            slope, growth = held_growth / span, held_growth
        # process memory alone, over few steps: growth or a heap still settling, not told apart
        unsure = trend and not device and not held and not locs and len(steps) < options.min_rss_steps
        if trend:
            head = f"{what} grew by {growth:.0f} MiB ({slope:.2f} MiB per step, rank correlation {rho:.2f})"
            if rehearsed_gpu:
                head += (", kept in tensors the program puts on the GPU: this CUDA rehearsal holds them in process "
                         "memory, on a GPU they take device memory")
        else:
            by = "module state" if not any(h.get("function") for h in holders) else "the program"
            head = f"Tensors kept by {by} grew by {growth:.0f} MiB ({slope:.2f} MiB per step, at every scan)"
        lead = ("Memory grew over a few steps: audit more steps to tell why. " if unsure else
                "Memory grows over the steps: stop keeping old tensors. " if held else
                "Memory grows over the steps: find what keeps it. ")
        yield self.finding(
            f"{lead}{head}; at this rate another 1,000 steps add {slope * 1000 / 1024:.1f} GiB"
            + (" of GPU memory." if rehearsed_gpu else ".")
            + (f" Read on {len(steps)} steps only, where a process's memory may still be settling (its heap, a "
               f"DataLoader's batches in flight) and no holder of the program's was seen growing: audit more steps "
               f"(--steps {max(200, 4 * len(ev.steps))}) to tell." if unsure else "")
            + (f" Held by {'module state' if not any(h.get('function') for h in holders) else 'the program'}: "
               f"{held}." if held else "") + (f" ({caps}.)" if caps else "") + allocs,
            severity="info" if unsure else None, locations=locs,
            evidence={"metric": metric, "unsure": unsure, "start_mib": round(ys[0], 1) if ys else None,
                      "end_mib": round(ys[-1], 1) if ys else None, "held_growth_mib": round(held_growth, 1),
                      "growth_mib": round(growth, 1), "mib_per_step": round(slope, 3), "spearman": round(rho, 3),
                      "steps_used": len(steps), "gpu_tensors_in_rehearsal": rehearsed_gpu,
                      "holders": [{k: h.get(k, 0) for k in ("name", "kind", "tensors", "bytes", "growth_bytes",
                                                            "device_growth_bytes")}
                                  | ({"function": h["function"]} if h.get("function") else {})
                                  for h in holders],
                      "capped": [{"name": h["name"], "bytes": h["bytes"], "bound_bytes": h["bound_bytes"],
                                  "bound": h["bound_why"]} for h in capped]},
            cost=None,
            fix=Fix(summary=_advice(holders[0], holder_key(holders[0]) in on_gpu) if holders else
                    "Stop keeping per-step tensors: keep summaries, clear buffers, detach and move to CPU."),
        )

    @staticmethod
    def _growing_holders(ev: m.Evidence) -> list[dict[str, Any]]:
        """Module globals (and module buffers and attributes) whose tensor bytes grew at every
        graph scan (a buffer that fills, then stays, is not growing without bound), biggest growth
        first."""
        if len(ev.graph_scans) < 2:
            return []
        scans = spread_scans(ev.graph_scans)
        series: dict[tuple[str, str], list[int]] = {}
        for k, scan in enumerate(scans):
            for h in scan.holders:
                series.setdefault(holder_key(h), [0] * len(scans))[k] = h.get("bytes", 0)
        on_device: dict[tuple[str, str], list[int]] = {}
        for k, scan in enumerate(scans):
            for h in scan.holders:
                on_device.setdefault(holder_key(h), [0] * len(scans))[k] = h.get("device_bytes", 0)
        grown = []
        for h in scans[-1].holders:
            b, d = series[holder_key(h)], on_device[holder_key(h)]
            if all(later > earlier for earlier, later in zip(b, b[1:])) and b[-1] - b[0] >= MiB:
                grown.append({**h, "growth_bytes": b[-1] - b[0], "device_growth_bytes": max(0, d[-1] - d[0])})
        return sorted(grown, key=lambda h: -h["growth_bytes"])


def _advice(h: dict[str, Any], gpu: bool) -> str:
    """The fix for the holder that grew most, by what it is: a list keeps one entry per step, a
    dict never evicts, a tensor or buffer is concatenated onto."""
    name, kind = h["name"], h.get("kind", "")
    if kind in ("list", "deque"):
        return (f"`{name}` keeps a tensor from every step" + (" on the GPU" if gpu else "") + ": keep what the "
                f"epoch needs as a running result instead (a sum, a count, a confusion matrix updated with "
                f"index_add_), or keep .cpu() copies"
                + (" (each .cpu() waits for the GPU: copy every N steps)" if gpu else "")
                + f", and clear `{name}` at each epoch's end.")
    if kind in ("dict", "OrderedDict", "defaultdict"):
        return (f"`{name}` gains entries every step and never drops any: bound it (evict the oldest keys) or keep "
                "summaries instead of tensors.")
    return (f"`{name}` is grown every step (concatenated onto): keep a fixed-size buffer (the last N rows) or a "
            "running summary instead.")


def _growing_allocation(ev: m.Evidence) -> tuple[str, LineGrowth | None]:
    """The line whose live allocations grew at every step's end of a recorded allocator history
    (the most growth), and the sentence naming it; ("", None) when none did."""
    lines = [g for snap in ev.snapshot_data for g in growing_lines(snap)]
    if not lines:
        return "", None
    g = max(lines, key=lambda g: g.live[-1] - g.live[0])
    per = (g.live[-1] - g.live[0]) // (len(g.live) - 1)
    return (f" The allocations made at {os.path.basename(g.frame.filename)}:{g.frame.line} stay alive and grow at "
            f"every step's end of the recorded allocator history ({format_bytes(per)} more per step, "
            f"{format_bytes(g.live[-1])} after {len(g.live)} steps); no name the graph scans reach holds them."), g
