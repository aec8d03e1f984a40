"""One rank's view from the evidence of its `audit run`: its identity (rank_of, world_size_of)
and its steps with communication separated from compute, with the sync points the merge matches
across ranks (info_from_run)."""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from auditor.evidence import model as m
from auditor.evidence.distributed import DistStep, frame_of
from auditor.evidence.frame import Frame
from auditor.evidence.phases import step_phases
from auditor.evidence.ranks.combine import site_key
from auditor.evidence.ranks.model import RankInfo, RankStep, SiteStat, SyncMap
from auditor.evidence.ranks.phases import COMM, PHASE_KINDS

RANK_DIR = re.compile(r"^rank-(\d+)$")  # the directory a rank's run is saved in under the job's


def rank_of(ev: m.Evidence, path: Path | None = None) -> int | None:
    """The rank an evidence belongs to: what its `audit run` process recorded, what the collector
    saw from torch.distributed, or the `rank-K` directory it was saved in."""
    for d in (ev.rank, ev.distributed):
        if d is not None and isinstance(d.rank, int):
            return d.rank
    if path is not None and (hit := RANK_DIR.match(Path(path).name)):
        return int(hit.group(1))
    return None


def world_size_of(ev: m.Evidence) -> int | None:
    """The size of the job an evidence belongs to, as its `audit run` process or the collector saw it."""
    for d in (ev.rank, ev.distributed):
        if d is not None and isinstance(d.world_size, int):
            return d.world_size
    return None


def info_from_run(ev: m.Evidence, rank: int, path: str = "") -> tuple[RankInfo, SyncMap]:
    """A rank's steps with communication separated from compute, and its sync points by key."""
    syncs: SyncMap = {}
    steps: list[RankStep] = []
    sites: dict[str, dict[str, Any]] = {}
    disturbed = auditor_disturbed(ev)
    for s in ev.steps:
        d = s.distributed or DistStep()
        points: dict[str, float] = {}
        grad_ms = 0.0
        counts: dict[int, int] = defaultdict(int)
        synced = 0
        for b in d.backward_syncs:
            if not b.synced:
                continue
            synced += 1
            k = counts[b.ddp]
            counts[b.ddp] += 1
            points[f"grad:{b.ddp}:{k}"] = b.sync_ms
            grad_ms += b.sync_ms
        buf_ms = 0.0
        for f in d.ddp_forwards:
            if f.buffer_syncs:
                points[f"buffers:{f.ddp}"] = f.buffer_sync_ms
                buf_ms += f.buffer_sync_ms
        coll_ms = 0.0
        for c in d.collectives:
            key = site_key(c.op, c.where)
            for n, ms in enumerate(c.ms):
                points[f"{key}#{n}"] = ms
            coll_ms += c.total_ms
            agg = sites.setdefault(key, {"op": c.op, "where": c.where, "calls": 0, "steps": 0, "ms": 0.0,
                                         "bytes": 0, "async_calls": 0})
            agg["calls"] += c.calls
            agg["steps"] += 1
            agg["ms"] += c.total_ms
            agg["bytes"] += c.bytes
            agg["async_calls"] += c.async_calls
        phases = step_phases(s)
        phases["backward"] = max(0.0, phases["backward"] - grad_ms)
        phases["forward"] = max(0.0, phases["forward"] - buf_ms)
        phases["other"] = max(0.0, phases["other"] - coll_ms)  # explicit collectives sit in the step body
        comm = grad_ms + buf_ms + coll_ms
        phases[COMM] = comm
        steps.append(RankStep(index=s.index, ms=s.ms, profiled=s.profiled, failed=s.failed,
                              phases={k: round(v, 4) for k, v in phases.items()}, comm_ms=round(comm, 4),
                              grad_syncs=synced, disturbed=s.index in disturbed))
        syncs[s.index] = points
    info = RankInfo(rank=rank, source="run", path=path, hostname=ev.environment.hostname,
                    local_rank=ev.rank.local_rank if ev.rank is not None else None,
                    backend=ev.distributed.backend if ev.distributed is not None else None, status=ev.ending.status,
                    ending_step=ev.ending.step, message=ev.ending.message, steps=steps,
                    sites=[SiteStat(op=a["op"], where=frame_of(a["where"]), calls=a["calls"], steps=a["steps"],
                                    ms=round(a["ms"], 4), bytes=a["bytes"], async_calls=a["async_calls"])
                           for a in sites.values()],
                    phase_sites=_phase_sites(ev), traces=list(ev.traces))
    return info, syncs


def auditor_disturbed(ev: m.Evidence) -> set[int]:
    """Steps whose sync points include waiting for the auditor itself on some rank: the graph-leak
    scan and the profiler's start and stop run between steps, outside the step's timing, so a rank
    doing them arrives late at the next step's first collective and the others wait there."""
    out = {g.after_step + 1 for g in ev.graph_scans}
    if ev.profile is not None and ev.profile.steps:
        out |= {min(ev.profile.steps), max(ev.profile.steps) + 1}
    return out


def _phase_sites(ev: m.Evidence) -> dict[str, Frame]:
    best: dict[str, tuple[float, Frame]] = {}
    totals: dict[tuple[str, Frame], float] = defaultdict(float)
    for s in ev.steps:
        for t in s.tallies:
            phase = PHASE_KINDS.get(t.kind)
            if phase and t.where is not None:
                totals[(phase, t.where)] += t.ms
    for (phase, where), ms in totals.items():
        if phase not in best or ms > best[phase][0]:
            best[phase] = (ms, where)
    return {p: f for p, (_, f) in best.items()}
