"""Per-rank evidence of a data-parallel run, merged into one view the distributed rules read.

Why a separate view: every rank of a DDP job runs the same code, so the per-rank rules (host syncs,
DataLoader settings...) are answered by one rank's evidence. What only the ranks *together* can tell
is who waits for whom. A collective finishes on every rank at about the same moment, so the rank
that arrives last spends the least time in it: that time is the transfer itself, and whatever any
other rank spent beyond it was waiting. Matching the same collective across ranks (the k-th
gradient sync of a step, the n-th call at one user line, the k-th NCCL kernel of a ProfilerStep)
needs no shared clock, so ranks on different hosts compare as well as ranks on one host.

Data model (stored in `Evidence.extra["ranks"]` as plain data, see RankSet):
- RankInfo per rank: identity, how it ended, and per step its wall time, where the time went
  (`phases`: data / forward / backward / optimizer / sync / cleanup / other with communication
  taken out, plus `comm`), the time spent in sync points (`comm_ms`) and, after merging, the part of
  it beyond the transfer (`wait_ms`). Explicit collectives are summarised per user line (SiteStat).
- The merged Evidence is the primary rank's (rank 0 when present) with `extra["ranks"]` added, so
  every existing rule still runs unchanged on one rank and the distributed rules see all of them.

Inputs: `audit run` rank directories (`DIR/rank-K/evidence.json`, written by
auditor.launch), or profiler traces whose `distributedInfo` names the rank
(auditor.evidence.ranks.traces). `merge_inputs(paths)` is the entry point `load_paths` calls for
`audit analyze`; auditor.reports.rank_plots renders the per-rank table and figure. Run
directories merge only when they are distinct ranks of one job (check_one_job): anything else is
the usage error of giving `audit analyze` two runs.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec

from auditor.evidence import model as m
from auditor.evidence.errors import InputError
from auditor.evidence.phases import PHASES, step_phases

RANKS_KEY = "ranks"
DIST_KEY = "distributed"  # the collector's name (auditor.capture.probes.dist)
RANK_KEY = "rank"  # identity a rank's `audit run` process adds to its own evidence
RANK_DIR = re.compile(r"^rank-(\d+)$")
COMM = "comm"
RANK_PHASES = (*PHASES, COMM)
PHASE_LABELS = {"data": "data loading", "forward": "forward", "backward": "backward", "optimizer": "optimizer step",
                "sync": "host syncs", "cleanup": "gc / empty_cache", "other": "other step code",
                COMM: "communication"}
_PHASE_KINDS = {m.DATA_WAIT: "data", m.DATA_ITER: "data", m.FORWARD: "forward", m.BACKWARD: "backward",
                m.OPTIMIZER: "optimizer",
                m.SYNC: "sync"}

SyncMap = dict[int, dict[str, float]]  # step index -> sync-point key -> ms this rank spent in it


class RankStep(msgspec.Struct):
    """One step of one rank."""

    index: int
    ms: float
    profiled: bool = False
    failed: bool = False
    phases: dict[str, float] = {}  # RANK_PHASES: communication taken out of the phase it happened in
    comm_ms: float = 0.0  # in sync points: gradient sync, buffer broadcast, explicit collectives
    wait_ms: float | None = None  # of comm_ms, the part beyond the fastest rank's (None: no other rank to compare)
    wait_by: dict[str, float] = {}  # wait_ms by kind of sync point: gradients, buffers, collectives, kernels
    grad_syncs: int = 0  # backward passes whose gradients DDP all-reduced
    disturbed: bool = False  # follows the auditor's own work between steps (graph scan, profiler start/stop)

    @property
    def busy_ms(self) -> float:
        """The step without the time spent waiting for other ranks (transfers included)."""
        return self.ms - (self.wait_ms or 0.0)

    @property
    def work_ms(self) -> float:
        """The step outside communication: the work only this rank can be slow at. Transfers are
        left out too: every rank moves the same bytes, and the fastest rank's transfer time is
        itself noisy, so it would blur who is slow."""
        return self.ms - self.comm_ms


class SiteStat(msgspec.Struct):
    """An explicit collective at one user line, over the whole run of one rank."""

    op: str
    where: m.Frame | None
    calls: int = 0
    steps: int = 0
    ms: float = 0.0
    wait_ms: float | None = None
    bytes: int = 0
    async_calls: int = 0


class RankInfo(msgspec.Struct):
    rank: int
    source: str = "run"  # run | trace
    path: str = ""
    hostname: str = ""
    local_rank: int | None = None
    backend: str | None = None
    status: str = "completed"
    ending_step: int | None = None
    message: str | None = None
    steps: list[RankStep] = []
    sites: list[SiteStat] = []
    phase_sites: dict[str, m.Frame] = {}  # where each phase's time was spent (largest site)
    traces: list[str] = []


class RankSet(msgspec.Struct):
    world_size: int | None
    ranks: list[RankInfo]
    missing: list[int] = []
    source: str = "run"
    notes: list[str] = []

    def get(self, rank: int) -> RankInfo | None:
        return next((r for r in self.ranks if r.rank == rank), None)


# ---------------------------------------------------------------------------------------------
# One rank from an `audit run` evidence.

def _site_key(op: str, where: dict[str, Any] | None) -> str:
    return f"{op}@{where['file']}:{where['line']}" if where else f"{op}@?"


def rank_of(ev: m.Evidence, path: Path | None = None) -> int | None:
    """The rank an evidence belongs to: what its `audit run` process recorded, what the collector
    saw from torch.distributed, or the `rank-K` directory it was saved in."""
    for d in (ev.rank, ev.distributed):
        if isinstance(d, dict) and isinstance(d.get("rank"), int):
            return d["rank"]
    if path is not None and (hit := RANK_DIR.match(Path(path).name)):
        return int(hit.group(1))
    return None


def world_size_of(ev: m.Evidence) -> int | None:
    for d in (ev.rank, ev.distributed):
        if isinstance(d, dict) and isinstance(d.get("world_size"), int):
            return d["world_size"]
    return None


def info_from_run(ev: m.Evidence, rank: int, path: str = "") -> tuple[RankInfo, SyncMap]:
    """A rank's steps with communication separated from compute, and its sync points by key."""
    syncs: SyncMap = {}
    steps: list[RankStep] = []
    sites: dict[str, dict[str, Any]] = {}
    disturbed = auditor_disturbed(ev)
    for s in ev.steps:
        d = s.distributed or {}
        points: dict[str, float] = {}
        grad_ms = 0.0
        counts: dict[int, int] = defaultdict(int)
        synced = 0
        for b in d.get("backward_syncs", []):
            if not b.get("synced", True):
                continue
            synced += 1
            k = counts[b["ddp"]]
            counts[b["ddp"]] += 1
            points[f"grad:{b['ddp']}:{k}"] = b["sync_ms"]
            grad_ms += b["sync_ms"]
        buf_ms = 0.0
        for f in d.get("ddp_forwards", []):
            if f.get("buffer_syncs"):
                points[f"buffers:{f['ddp']}"] = f["buffer_sync_ms"]
                buf_ms += f["buffer_sync_ms"]
        coll_ms = 0.0
        for c in d.get("collectives", []):
            key = _site_key(c["op"], c.get("where"))
            for n, ms in enumerate(c["ms"]):
                points[f"{key}#{n}"] = ms
            coll_ms += c["total_ms"]
            agg = sites.setdefault(key, {"op": c["op"], "where": c.get("where"), "calls": 0, "steps": 0, "ms": 0.0,
                                         "bytes": 0, "async_calls": 0})
            agg["calls"] += c["calls"]
            agg["steps"] += 1
            agg["ms"] += c["total_ms"]
            agg["bytes"] += c["bytes"]
            agg["async_calls"] += c.get("async_calls", 0)
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
                    local_rank=(ev.rank or {}).get("local_rank"),
                    backend=(ev.distributed or {}).get("backend"), status=ev.ending.status,
                    ending_step=ev.ending.step, message=ev.ending.message, steps=steps,
                    sites=[SiteStat(op=a["op"], where=m.recorded_frame(a["where"]), calls=a["calls"], steps=a["steps"],
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


def _phase_sites(ev: m.Evidence) -> dict[str, m.Frame]:
    best: dict[str, tuple[float, m.Frame]] = {}
    totals: dict[tuple[str, m.Frame], float] = defaultdict(float)
    for s in ev.steps:
        for t in s.tallies:
            phase = _PHASE_KINDS.get(t.kind)
            if phase and t.where is not None:
                totals[(phase, t.where)] += t.ms
    for (phase, where), ms in totals.items():
        if phase not in best or ms > best[phase][0]:
            best[phase] = (ms, where)
    return {p: f for p, (_, f) in best.items()}


# ---------------------------------------------------------------------------------------------
# Merging: the same sync point across ranks; the fastest rank's time is the transfer.

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
            st, wait_ms=round(site_wait[(info.rank, _site_key(st.op, _where_dict(st.where)))], 4)
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


def _where_dict(f: m.Frame | None) -> dict[str, Any] | None:
    return {"file": f.file, "line": f.line} if f else None


# ---------------------------------------------------------------------------------------------
# Reading the view back from an Evidence, whatever its source.

def rank_set(ev: m.Evidence) -> RankSet | None:
    """The ranks behind an Evidence: the merged view when present, else the one rank a run holds
    (when it saw anything distributed), else the ranks its traces name. None: nothing distributed."""
    stored = ev.ranks
    if stored:
        return msgspec.convert(stored, RankSet)
    if ev.source == "run" and ev.distributed is not None:
        rank = rank_of(ev)
        return combine([info_from_run(ev, rank if rank is not None else 0)], world_size_of(ev), "run")
    if ev.trace_data:
        from auditor.evidence.ranks.traces import ranks_from_traces

        return ranks_from_traces(ev.trace_data)
    return None


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


# ---------------------------------------------------------------------------------------------
# Building the merged Evidence.

def _relative(path: str, base: Path | None) -> str:
    """`path` relative to the directory the evidence is saved in, else absolute."""
    if base is None:
        return str(Path(path).resolve())
    try:
        return str(Path(path).resolve().relative_to(base.resolve()))
    except ValueError:
        return path


def _launcher_stopped(ev: m.Evidence) -> bool:
    """Killed by SIGTERM/SIGKILL or interrupted: what a launcher does to the others once one rank fails."""
    e = ev.ending
    return e.status == "interrupted" or (e.status == "crashed" and e.signal in ("SIGTERM", "SIGKILL", "SIGINT"))


_PEER_GONE = ("DistBackendError", "DistNetworkError")
_PEER_GONE_TEXT = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "gloo/", "NCCL")


def _peer_gone(ev: m.Evidence) -> bool:
    """Raised by a collective because another rank went away (gloo's "Connection closed by peer"):
    a consequence of that rank's failure, whichever process ended first."""
    e = ev.ending
    return e.status == "raised" and (e.exception in _PEER_GONE or any(t in (e.message or "") for t in _PEER_GONE_TEXT))


def _root_failure(runs: list[tuple[int, m.Evidence]]) -> tuple[int, m.Evidence] | None:
    """The rank whose failure started it: a rank that failed on its own before one a launcher stopped
    or one whose collective lost its peer, then the earliest to end."""
    failed = [(r, ev) for r, ev in runs if not m.ended_well(ev.ending)]
    if not failed:
        return None
    return min(failed, key=lambda p: (_launcher_stopped(p[1]), _peer_gone(p[1]),
                                      (p[1].rank or {}).get("ended_at") or math.inf, p[0]))


def merge_runs(runs: list[tuple[m.Evidence, Path]], world_size: int | None = None,
               out: Path | None = None) -> m.Evidence:
    """One Evidence from the evidence of several ranks (see the module docstring).

    `out`: the directory the merged evidence will be saved in; paths under it are stored relative."""
    ranked = []
    for i, (ev, path) in enumerate(runs):
        r = rank_of(ev, path)
        ranked.append((r if r is not None else i, ev, path))
    ranked.sort(key=lambda t: t[0])
    world_size = world_size or next((w for _, ev, _ in ranked if (w := world_size_of(ev))), None)
    parts = [info_from_run(ev, r, _relative(str(p), out)) for r, ev, p in ranked]
    rs = combine(parts, world_size, "run")
    rank0, primary, primary_path = ranked[0]
    merged = m.decode(m.encode(primary))  # a copy: the rank's own evidence stays as it was
    merged.traces = [_relative(t, out) for t in primary.traces]
    if merged.profile is not None:
        merged.profile.trace_files = [_relative(str(primary_path / t), out) if not Path(t).is_absolute() else t
                                      for t in primary.profile.trace_files]
    root = _root_failure([(r, ev) for r, ev, _ in ranked])
    if root is not None:
        r, ev = root
        merged.ending = msgspec.structs.replace(ev.ending, message=f"rank {r}: {ev.ending.message or ev.ending.status}")
    if rs.missing:
        rs.notes.append(f"no evidence from rank(s) {rank_ranges(rs.missing)} of {world_size}: they did not finish "
                        "writing it, or wrote it on another machine (copy their rank-K/ directories here and run "
                        "`audit analyze DIR`)")
    for r, ev, _ in ranked:
        if r != rank0 and ev.ending.status != "completed":
            rs.notes.append(f"rank {r} ended: {ev.ending.status}"
                            + (f" in step {ev.ending.step}" if ev.ending.step is not None else "")
                            + (f" ({ev.ending.message})" if ev.ending.message else ""))
    merged.environment.notes = [*merged.environment.notes,
                                f"Merged from {len(ranked)} rank(s) ({rank_ranges([r for r, _, _ in ranked])}"
                                + (f" of {world_size}" if world_size else "") + f"); per-rank rules read rank "
                                f"{rank0}'s evidence, the distributed rules compare all ranks.", *rs.notes]
    merged.ranks = msgspec.to_builtins(rs)
    return merged


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


def find_rank_dirs(path: Path) -> list[Path]:
    """`rank-K/` run directories directly under `path`, in rank order."""
    from auditor.evidence.store import is_run_dir

    if not path.is_dir():
        return []
    found = [(int(h.group(1)), p) for p in path.iterdir() if (h := RANK_DIR.match(p.name)) and is_run_dir(p)]
    return [p for _, p in sorted(found)]


def load_rank_dirs(dirs: list[Path], out: Path | None = None) -> m.Evidence:
    """The merged Evidence of rank run directories, after checking they are the ranks of one job."""
    from auditor.evidence.store import load_run_dir

    runs = [(load_run_dir(d), d) for d in dirs]
    if len(runs) > 1:  # (one rank-K/ found under a directory: a job's one surviving rank)
        check_one_job(runs)
    return merge_runs(runs, out=out)


ONE_RUN = "only one `audit run` directory can be analyzed at a time"


def _target_key(target: str) -> str:
    """A TARGET as every rank of one job names it: nodes may spell the path to the same file
    differently (relative, absolute), so a file target compares by file name and callable."""
    left, sep, attr = target.rpartition(":")
    if sep and (left.endswith(".py") or "/" in left):
        return f"{Path(left).name}:{attr}"
    return target


def check_one_job(runs: list[tuple[m.Evidence, Path]]) -> None:
    """Raise InputError unless `runs` are distinct ranks of one distributed job.

    Why: merging compares the ranks step by step and calls the slowest one a straggler, so two
    unrelated runs (or one directory given twice) merged as "2 ranks" would yield a made-up
    finding. A rank's `audit run` records who it is (`extra["rank"]`: rank, world size, the
    launcher's run id) and its TARGET; ranks of one job agree on all but the rank, which differs.
    A merged report (`DIR/evidence.json` of a job) is not one more rank either."""
    seen: dict[Path, Path] = {}
    for _, path in runs:
        key = path.resolve()
        if key in seen:
            raise InputError(f"{ONE_RUN}: {path} is given twice")
        seen[key] = path
    first: tuple[m.Evidence, Path, int, int] | None = None
    by_rank: dict[int, Path] = {}
    for ev, path in runs:
        if ev.ranks:
            raise InputError(f"{ONE_RUN}: {path} holds the merged report of a distributed run, not one of its "
                             f"ranks (give it alone, or only its rank-K/ directories)")
        rank, world = rank_of(ev), world_size_of(ev)
        if rank is None or world is None or not 0 <= rank < world:
            raise InputError(f"{ONE_RUN}: {path} is not a rank of a distributed run")
        if rank in by_rank:
            raise InputError(f"{ONE_RUN}: {by_rank[rank]} and {path} are both rank {rank}")
        by_rank[rank] = path
        if first is None:
            first = (ev, path, rank, world)
            continue
        ev0, path0, rank0, world0 = first
        run0, run = ((e.rank or {}).get("run_id") for e in (ev0, ev))
        if world != world0:
            raise InputError(f"{ONE_RUN}: {path} is rank {rank} of {world}, {path0} rank {rank0} of {world0}")
        if run0 is not None and run is not None and run != run0:
            raise InputError(f"{ONE_RUN}: {path} is rank {rank} of another run than {path0} "
                             f"(run id {run}, not {run0})")
        if _target_key(ev.target) != _target_key(ev0.target):
            raise InputError(f"{ONE_RUN}: {path} audited {ev.target}, {path0} audited {ev0.target}")


def merge_inputs(paths: list[Path]) -> m.Evidence | None:
    """For `load_paths`: the merged Evidence when `paths` are the ranks of one job, else None.

    Recognised: a directory of `rank-K/` run directories (without its own evidence.json), several
    rank run directories, and profiler traces (files or directories of them) naming at least two
    different ranks in `distributedInfo`. The result carries parsed traces of the primary rank in
    `trace_data`, as load_paths would attach them.

    Raises InputError when several run directories are not the ranks of one job (check_one_job).
    """
    from auditor.evidence.load import find_traces
    from auditor.evidence.store import is_run_dir

    paths = [Path(p) for p in paths]
    run_dirs: list[Path] = []
    parents = others = 0
    for p in paths:
        if is_run_dir(p):
            run_dirs.append(p)
        elif sub := find_rank_dirs(p):
            run_dirs.extend(sub)
            parents += 1
        else:
            others += 1
    if run_dirs:
        if others or (len(run_dirs) == 1 and not parents):
            return None  # one plain run, or runs mixed with other inputs: the ordinary path
        merged = load_rank_dirs(run_dirs)
        return _attach_traces(merged, [Path(t) for t in merged.traces])
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            files.extend(find_traces(p))
        elif p.name.endswith((".json", ".json.gz")):
            files.append(p)
        else:
            return None
    if len(files) < 2:
        return None
    from auditor.evidence.ranks.traces import merge_trace_files

    return merge_trace_files(files)


def _attach_traces(ev: m.Evidence, paths: list[Path]) -> m.Evidence:
    from auditor.evidence.trace import load_trace

    parsed = []
    for p in paths:
        if p.is_file():
            parsed.append(load_trace(p))
        else:
            m.add_load_note(ev, f"profiler trace {p} listed by the run is missing")  # (as load_paths says it)
    ev.__dict__["trace_data"] = parsed
    ev.__dict__["snapshot_data"] = []
    return ev

