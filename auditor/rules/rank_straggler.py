"""rank-straggler: one or a few ranks are consistently slower, and every other rank waits for them."""
from __future__ import annotations

from statistics import median
from typing import Iterable

from auditor.evidence import model as m
from auditor.evidence.ranks.combine import compared_steps
from auditor.evidence.ranks.model import RankSet
from auditor.evidence.ranks.phases import COMM, PHASE_LABELS, RANK_PHASES
from auditor.evidence.ranks.scale import NAMED_RANKS, UNKNOWN_HOST, host_of, median_without, name_ranks, spread
from auditor.evidence.ranks.view import rank_set
from auditor.rules.base import Option, Options, Rule
from auditor.findings import Cost, Finding, Fix, Location, share_of_step, step_basis_ms

_FIXES = {
    "data": "Give the slow rank's input pipeline more DataLoader workers or prefetching, move its shard to storage "
            "as fast as the others', or rebalance the shards.",
    "forward": "Give every rank the same amount of work per step (equal local batch sizes and sequence lengths, "
               "e.g. bucket by length), and check the slow rank's device/CPU for throttling or contention.",
    "backward": "Give every rank the same amount of work per step (equal local batch sizes and sequence lengths), "
                "and check the slow rank's device/CPU for throttling or contention.",
    "optimizer": "Make the optimizer step equal across ranks (no rank-0-only work inside the step).",
    "sync": "Remove the extra host syncs the slow rank makes (`.item()`, prints, logging only on that rank).",
    "cleanup": "Stop calling gc.collect()/empty_cache() on the slow rank inside the step.",
    "other": "Move rank-specific work (logging, checkpointing, evaluation on rank 0) out of the step, or onto a "
             "background thread, or give it to every rank in turn.",
}


class RankStraggler(Rule):
    """
    What it detects:
        One or a few ranks of a data-parallel job that need more time per step than the others in
        most steps. It names them, the phase where they lose the time (data loading, forward,
        backward, optimizer step, host syncs, other step code) and how long the other ranks wait
        for them in the collectives that follow.

    Why it costs:
        Every collective (DDP's gradient all-reduce, a barrier, a metric all-reduce) finishes only
        when the last rank arrives, so the whole job runs at the pace of its slowest rank: each
        other rank idles for the difference, every step. With N ranks, one straggler wastes up to
        N-1 times its own excess.

    Example:
        bad:   rank 1 reads its shard from a slower disk; its batches arrive 30 ms later each step
        good:  shards on equally fast storage, or enough DataLoader workers on every rank

    Fix:
        Remove the imbalance in the phase named: equal local batches and sequence lengths, an
        input pipeline fast enough on every rank, no rank-specific work (logging, evaluation,
        checkpointing) inside the step.

    Evidence needed:
        Two or more ranks: `audit run --nproc-per-node N`, `torchrun ... -m auditor run`, or
        per-rank profiler traces (`distributedInfo` names the rank). Each rank's time in its sync
        points is compared call by call; the rank that arrives last waits least.
    """

    id = "rank-straggler"
    saves_on = "step"
    title = "A slow rank makes every other rank wait"
    severity = "warning"
    category = "performance"
    needs = frozenset({"run", "trace"})
    needs_text = "needs the evidence of two or more ranks (a distributed run or per-rank traces)"
    options = (
        Option("min-excess-share", 0.25, "Flag a rank whose own work per step (outside communication) exceeds "
                                         "the others' by this share of the median step.",
               high=float("inf")),  # (a rank may take twice the step: a share past 1)
        Option("min-excess-ms", 1.0, "... and by at least this many milliseconds."),
        Option("min-share-of-steps", 0.6, "... in at least this share of the steps all ranks completed."),
        Option("noise-factor", 3.0, "... and by this many times the step-to-step jitter (median absolute "
                                    "deviation) of the other ranks' own work, so a noisy machine is not a straggler."),
    )

    def skip_reason(self, ev: m.Evidence) -> str | None:
        rs = rank_set(ev)
        if rs is None or len(rs.ranks) < 2:
            return self.needs_text
        if len(compared_steps(rs)) < 2:
            return "fewer than two steps that two or more ranks completed"
        return None

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        rs = rank_set(ev)
        assert rs is not None
        steps = compared_steps(rs)
        step_ms = median(s.ms for row in steps.values() for s in row.values())
        base = max(options["min-excess-ms"], options["min-excess-share"] * step_ms)
        excess: dict[int, list[float]] = {}
        for row in steps.values():
            works = sorted(s.work_ms for s in row.values())
            for r, s in row.items():
                excess.setdefault(r, []).append(s.work_ms - median_without(works, s.work_ms))
        jitters = _jitters(steps)
        ordered_jitters = sorted(jitters.values())
        slow = []
        for r, xs in excess.items():
            jitter = (median_without(ordered_jitters, jitters[r]) if r in jitters and len(ordered_jitters) > 1
                      else median(ordered_jitters) if ordered_jitters and r not in jitters else 0.0)
            threshold = max(base, options["noise-factor"] * jitter)
            if median(xs) >= threshold and \
                    sum(x >= threshold / 2 for x in xs) >= options["min-share-of-steps"] * len(xs):
                slow.append(r)
        world = len({r for row in steps.values() for r in row})
        if not slow or len(slow) > world / 2:
            return
        slow.sort(key=lambda r: -median(excess[r]))
        yield self._finding(rs, steps, slow, excess, step_ms, step_basis_ms(ev))

    def _finding(self, rs: RankSet, steps: dict, slow: list[int], excess: dict[int, list[float]],
                 step_ms: float, basis_ms: float | None) -> Finding:
        fast_rows = [[s for r, s in row.items() if r not in slow] for row in steps.values()]
        others_wait = round(median(median(s.wait_ms or 0.0 for s in row) for row in fast_rows if row), 3)
        share = share_of_step(others_wait, basis_ms)  # (of the step the report states, as every cost's)
        deltas = _phase_deltas(steps, slow)
        lead = slow[0]
        phase, phase_ms = max(((p, d) for p, d in deltas[lead].items() if p != COMM), key=lambda t: t[1])
        info = rs.get(lead)
        where = info.phase_sites.get(phase) if info else None
        hosts = {r: host_of(rs.get(r)) for r in slow}
        known = sorted({h for h in hosts.values() if h != UNKNOWN_HOST})
        names = name_ranks(slow)
        if len(slow) <= NAMED_RANKS and known:
            names = ", ".join(f"{r} (host {hosts[r]})" for r in slow)
        elif known and len(known) == 1 and len(known) == len(set(hosts.values())):
            names = f"{names}, all on host {known[0]}"
        fast = sorted({r for row in steps.values() for r in row} - set(slow))
        waiters = (f"rank {fast[0]} waits" if len(fast) == 1 else
                   f"ranks {', '.join(map(str, fast))} wait" if len(fast) <= 4 else f"the other {len(fast)} ranks wait")
        message = (("Some ranks are slower and the others wait: look at their " if len(slow) > 1 else
                    "One rank is slower and the others wait: look at its ") + f"{PHASE_LABELS[phase]}. "
                   + f"Rank{'s' if len(slow) > 1 else ''} {names} {'are' if len(slow) > 1 else 'is'} slower than the "
                   f"others in most steps (+{median(excess[lead]):.1f} ms of its own work per step, median over "
                   f"{len(steps)} steps); the time is lost in {PHASE_LABELS[phase]} (+{phase_ms:.1f} ms per step vs "
                   f"the other ranks), and {waiters} {others_wait:.1f} ms per step for "
                   f"{'them' if len(slow) > 1 else 'it'} in collectives"
                   + (f" ({share:.0%} of the run's time)." if share is not None else "."))
        work = {r: median(row[r].work_ms for row in steps.values() if r in row)
                for r in sorted({r for row in steps.values() for r in row})}
        return self.finding(
            message,
            locations=[Location.of(where)] if where else [],
            evidence={"stragglers": slow, "hosts": {str(r): h for r, h in hosts.items()},
                      "work_ms_spread": spread(list(work.values())), "ranks_compared": len(work),
                      "phase": phase, "phase_label": PHASE_LABELS[phase],
                      "excess_ms": {str(r): round(median(excess[r]), 3) for r in slow},
                      "phase_excess_ms": {str(r): {p: round(d, 3) for p, d in deltas[r].items()} for r in slow},
                      "others_wait_ms": round(others_wait, 3), "median_step_ms": round(step_ms, 3),
                      "steps_compared": sorted(steps), "source": rs.source,
                      "per_rank_work_ms": {str(r): round(w, 3) for r, w in sorted(work.items())}},
            cost=Cost(ms_per_step=others_wait, share_of_step=share,
                      measured=True, note="time each other rank waits per step"),
            fix=Fix(summary=_FIXES.get(phase, _FIXES["other"])),
        )


def _jitters(steps: dict) -> dict[int, float]:
    """Per rank with two steps or more, the median absolute deviation of its own work over steps:
    how much a rank's step varies by itself on this machine. A rank is judged against the median
    of the other ranks' (median_without)."""
    by_rank: dict[int, list[float]] = {}
    for row in steps.values():
        for r, s in row.items():
            by_rank.setdefault(r, []).append(s.work_ms)
    out = {}
    for r, xs in by_rank.items():
        if len(xs) >= 2:
            mid = median(xs)
            out[r] = median(abs(x - mid) for x in xs)
    return out


def _phase_deltas(steps: dict, slow: list[int]) -> dict[int, dict[str, float]]:
    """Per slow rank and phase: median over steps of (its phase time - the other ranks' median)."""
    slow_set = set(slow)
    typical: dict[int, dict[str, float]] = {}  # step -> phase -> the other ranks' median (the same for each slow rank)
    for i, row in steps.items():
        others = [s for k, s in row.items() if k not in slow_set]
        if others:
            typical[i] = {p: median(o.phases.get(p, 0.0) for o in others) for p in RANK_PHASES}
    out: dict[int, dict[str, float]] = {}
    for r in slow:
        per_phase: dict[str, list[float]] = {p: [] for p in RANK_PHASES}
        for i, row in steps.items():
            if r not in row:
                continue
            if i in typical:
                mid = typical[i]
            else:  # every rank of the step is slow: against the others
                others = [s for k, s in row.items() if k != r]
                mid = {p: median(o.phases.get(p, 0.0) for o in others) for p in RANK_PHASES}
            for p in RANK_PHASES:
                per_phase[p].append(row[r].phases.get(p, 0.0) - mid[p])
        out[r] = {p: median(v) for p, v in per_phase.items() if v}
    return out
