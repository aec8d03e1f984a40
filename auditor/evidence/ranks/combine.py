"""Merging ranks: the same sync point across ranks, where the fastest rank's time is the transfer
and whatever any other rank spent beyond it was waiting (combine); the steps the rules compare
(compared_steps)."""
from __future__ import annotations

from collections import defaultdict

import msgspec

from auditor.evidence.distributed import CallSite
from auditor.evidence.frame import Frame
from auditor.evidence.ranks.model import RankInfo, RankSet, RankStep, SyncMap


def site_key(op: str, where: CallSite | Frame | None) -> str:
    """The key of an explicit collective's user line, the same on every rank."""
    return f"{op}@{where.file}:{where.line}" if where else f"{op}@?"


def combine(parts: list[tuple[RankInfo, SyncMap]], world_size: int | None, source: str) -> RankSet:
    """Set each step's `wait_ms` (and each site's) from the sync points every rank of that step shares."""
    by_step: dict[int, list[tuple[RankInfo, dict[str, float]]]] = defaultdict(list)
    for info, syncs in parts:
        for index, points in syncs.items():
            by_step[index].append((info, points))
    site_wait: dict[tuple[int, str], float] = defaultdict(float)
    step_wait: dict[tuple[int, int], float] = {}
    step_wait_by: dict[tuple[int, int], dict[str, float]] = {}
    for index, members in by_step.items():
        if len(members) < 2:
            continue
        shared = set.intersection(*(set(p) for _, p in members))
        fastest = {k: min(p[k] for _, p in members) for k in shared}
        for info, points in members:
            total = 0.0
            by: dict[str, float] = defaultdict(float)
            for k in shared:
                w = points[k] - fastest[k]
                total += w
                by[sync_kind(k)] += w
                if "@" in k:
                    site_wait[(info.rank, k.rsplit("#", 1)[0])] += w
            step_wait[(info.rank, index)] = round(total, 4)
            step_wait_by[(info.rank, index)] = {k: round(v, 4) for k, v in by.items()}
    infos = []
    for info, _ in parts:
        steps = [msgspec.structs.replace(s, wait_ms=step_wait.get((info.rank, s.index)),
                                         wait_by=step_wait_by.get((info.rank, s.index), {})) for s in info.steps]
        sites = [msgspec.structs.replace(
            st, wait_ms=round(site_wait[(info.rank, site_key(st.op, st.where))], 4)
            if len(parts) > 1 else None) for st in info.sites]
        infos.append(msgspec.structs.replace(info, steps=steps, sites=sites))
    infos.sort(key=lambda i: i.rank)
    present = {i.rank for i in infos}
    missing = [r for r in range(world_size)] if world_size else []
    return RankSet(world_size=world_size, ranks=infos, missing=[r for r in missing if r not in present],
                   source=source)


def sync_kind(key: str) -> str:
    """What a sync-point key stands for: DDP's gradient all-reduce, its buffer broadcast, an explicit
    collective at a user line, or a communication kernel/range of a trace."""
    if key.startswith("grad:"):
        return "gradients"
    if key.startswith("buffers:"):
        return "buffers"
    if key.startswith("comm:"):
        return "kernels"
    return "collectives"


def compared_steps(rs: RankSet) -> dict[int, dict[int, RankStep]]:
    """step index -> rank -> step, for the steps at least two ranks completed and can be compared.
    Profiled steps and steps disturbed by the auditor's between-step work are left out when others
    remain (see auditor_disturbed), and the first two steps (warm-up; DDP rebuilds its buckets in the second)."""
    table: dict[int, dict[int, RankStep]] = defaultdict(dict)
    for info in rs.ranks:
        for s in info.steps:
            if not s.failed and s.wait_ms is not None:
                table[s.index][info.rank] = s
    rows = {i: r for i, r in table.items() if len(r) >= 2}
    if rs.source == "run":
        plain = {i: r for i, r in rows.items() if not any(s.profiled or s.disturbed for s in r.values())}
        if len(plain) >= 3:
            rows = plain
        for _ in range(2):  # step 0 warms up; in step 1 DDP rebuilds its buckets (a broadcast in forward)
            if len(rows) >= 5:
                rows.pop(min(rows), None)
    return dict(sorted(rows.items()))


def rank_ranges(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    out, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(out)
