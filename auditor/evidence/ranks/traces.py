"""One rank's view from profiler traces, for `audit analyze` of per-rank traces.

Why traces too: on GPU clusters the profiler trace is often all there is, one per rank, and each
names its rank in `distributedInfo`. A ProfilerStep gives the step's wall time; NCCL kernels (or,
on CPU, the gloo/nccl record_function ranges) are the sync points, matched across ranks as the k-th
communication of the same ProfilerStep; DataLoader, DDP forward and optimizer ranges give the
host-side phases that can be named. Backward is not separated (on GPU it runs on autograd threads):
it stays in "other". Communication on the GPU overlaps compute, so a trace rank's `comm_ms` is
device time set against a host step: consistent between ranks, which is what the comparison needs.
"""
from __future__ import annotations

import re
import zlib
from collections import defaultdict
from collections.abc import Iterable

import msgspec

from auditor.evidence import model as m
from auditor.evidence.ranks.combine import combine, rank_ranges
from auditor.evidence.ranks.model import RankInfo, RankSet, RankStep, SyncMap
from auditor.evidence.ranks.phases import COMM, RANK_PHASES
from auditor.evidence.trace.decode import GPU_WORK
from auditor.evidence.trace.intervals import intersect, merge_intervals, total_length
from auditor.evidence.trace.model import Trace

# Names a trace gives communication: NCCL kernels on the GPU, gloo/nccl record_function ranges on the host.
COMM_KERNEL = re.compile(r"nccl|rccl|c10d", re.I)
_COMM_HOST = re.compile(r"^(gloo|nccl|mpi|ucc):[a-z_]+$", re.I)
_TRACE_PHASES = {"data": re.compile(r"DataLoader.*__next__"),
                 "forward": re.compile(r"^DistributedDataParallel\.forward$"),
                 "optimizer": re.compile(r"^Optimizer\.step#")}


def comm_tag(name: str) -> str:
    """A communication's name as its sync-point key holds it: a short checksum of the full name (the
    k-th communication of a step matches across ranks only when its name does too). The key is
    kept per step and rank, hundreds per step in an FSDP job, and names run to 100 characters."""
    return f"{zlib.crc32(name.encode()):08x}"


def _union_ms(starts: list[float], ends: list[float]) -> float:
    """Length in ms of the union of [start, end] ranges in us: nested ranges (a DataLoader call
    inside another) count once."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(zip(starts, ends)):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total / 1e3


# The most ranks a trace's distributedInfo is believed to name: a rank or world_size past it (10**20)
# is a value of the wrong type, as a string or a list is, and is left out.
MAX_RANKS = 1 << 17


def trace_rank(trace: Trace) -> int | None:
    """The rank a trace's `distributedInfo` names, or None."""
    rank = trace.distributed_info.get("rank")
    if isinstance(rank, str) and rank.isdigit() and len(rank) <= 7:
        rank = int(rank)
    return rank if isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < MAX_RANKS else None


def trace_world_size(trace: Trace) -> int | None:
    """The world size a trace's `distributedInfo` names, or None."""
    world = trace.distributed_info.get("world_size")
    return world if isinstance(world, int) and not isinstance(world, bool) and 0 < world <= MAX_RANKS else None


def info_from_traces(traces: list[Trace], rank: int) -> tuple[RankInfo, SyncMap]:
    """A rank's ProfilerSteps: wall time, data / forward / optimizer ranges on the host, and the
    communication the trace records (NCCL kernels on the GPU, else gloo/nccl host ranges)."""
    steps: list[RankStep] = []
    syncs: SyncMap = {}
    backend = None
    for trace in traces:
        backend = backend or trace.distributed_info.get("backend")
        events = trace.events
        kernels = trace.of("kernel")
        comm = trace.matching(COMM_KERNEL, kernels)
        on_gpu = len(comm) > 0
        compute = None
        if on_gpu:  # the GPU's other work, by step: what communication may hide behind
            work = events[events["cat"].isin(GPU_WORK)]
            compute = work.drop(index=comm.index, errors="ignore")
        else:
            comm = trace.matching(_COMM_HOST, trace.of("cpu_op", "annotation"))
        for _, st in trace.steps.iterrows():
            n = int(st["step"])
            lo, hi = float(st["ts"]), float(st["end"])
            in_step = comm[comm["step"] == n] if on_gpu else comm[(comm["ts"] >= lo) & (comm["ts"] < hi)]
            in_step = in_step.sort_values("ts")
            names = {int(c): comm_tag(trace.symbols[int(c)]) for c in set(in_step["name"])}
            points = {f"comm:{k}:{names[int(c)]}": float(d) / 1e3
                      for k, (c, d) in enumerate(zip(in_step["name"], in_step["dur"]))}
            phases = dict.fromkeys(RANK_PHASES, 0.0)
            host = events[(events["ts"] >= lo) & (events["ts"] < hi)]
            for phase, pattern in _TRACE_PHASES.items():
                sel = trace.matching(pattern, host)
                phases[phase] = _union_ms(list(sel["ts"]), list(sel["end"]))
            comm_ms = _union_ms(list(in_step["ts"]), list(in_step["end"]))
            phases[COMM] = comm_ms
            ms = (hi - lo) / 1e3
            phases["other"] = max(0.0, ms - sum(phases[p] for p in _TRACE_PHASES) - (0.0 if on_gpu else comm_ms))
            exposed = None
            if compute is not None:
                spans = merge_intervals(in_step["ts"].to_numpy(), in_step["end"].to_numpy())
                mine = compute[compute["step"] == n]
                hidden = intersect(spans, merge_intervals(mine["ts"].to_numpy(), mine["end"].to_numpy()))
                exposed = round((total_length(spans) - total_length(hidden)) / 1e3, 4)
            steps.append(RankStep(index=n, ms=ms, phases={k: round(v, 4) for k, v in phases.items()},
                                  comm_ms=round(comm_ms, 4), profiled=True, exposed_ms=exposed))
            syncs[n] = points
    steps.sort(key=lambda s: s.index)
    info = RankInfo(rank=rank, source="trace", path=str(traces[0].path) if traces else "", backend=backend,
                    steps=steps, traces=[str(t.path) for t in traces])
    return info, syncs


def ranks_from_traces(traces: list[Trace]) -> RankSet | None:
    """Group parsed traces by the rank their `distributedInfo` names; None when none names one."""
    by_rank: dict[int, list[Trace]] = defaultdict(list)
    world = None
    for t in traces:
        r = trace_rank(t)
        if r is not None:
            by_rank[r].append(t)
            world = world or trace_world_size(t)
    if not by_rank:
        return None
    return combine([info_from_traces(ts, r) for r, ts in sorted(by_rank.items())],
                   world if isinstance(world, int) else None, "trace")


def merge_traces(traces: Iterable[Trace]) -> tuple[m.Evidence | None, list[Trace]]:
    """One Evidence from parsed traces of at least two ranks, and the parsed traces it keeps.

    `traces` are consumed one at a time (they can be large, and an iterator may parse each only
    when it is asked for): while they name one rank, every trace is kept; once a second rank
    appears, only the primary rank's (the lowest). The Evidence is None when the traces are not
    per-rank traces of two ranks or more (a trace names no rank, or all name the same one): the
    list then holds the traces read so far, for the caller to analyse without parsing them again
    (all of them, unless a trace naming no rank came after traces of two ranks)."""
    parts: dict[int, list[tuple[RankInfo, SyncMap]]] = defaultdict(list)
    held: list[Trace] = []
    world = None
    dropped: list[str] = []
    for trace in traces:
        rank = trace_rank(trace)
        if rank is None:
            return None, [*held, trace]  # a trace that names no rank: not a set of per-rank traces
        if trace.dropped:
            dropped.append(f"{trace.path.name}: {trace.dropped}")
        world = world or trace_world_size(trace)
        parts[rank].append(info_from_traces([trace], rank))
        held.append(trace)
        if len(parts) > 1:
            primary = min(parts)
            held = [t for t in held if trace_rank(t) == primary]
    if len(parts) < 2:
        return None, held
    infos = []
    for rank, pieces in sorted(parts.items()):
        info = msgspec.structs.replace(pieces[0][0], steps=sorted((s for i, _ in pieces for s in i.steps),
                                                                   key=lambda s: s.index),
                                       traces=[t for i, _ in pieces for t in i.traces])
        syncs: SyncMap = {}
        for _, sm in pieces:
            syncs.update(sm)
        infos.append((info, syncs))
    rs = combine(infos, world if isinstance(world, int) else None, "trace")
    primary = rs.ranks[0]
    ev = m.Evidence(source="trace", traces=primary.traces)
    ev.environment.notes.append(f"Merged profiler traces of {len(rs.ranks)} rank(s) "
                                f"({rank_ranges([r.rank for r in rs.ranks])}"
                                + (f" of {rs.world_size}" if rs.world_size else "")
                                + f"); trace rules read rank {primary.rank}'s traces, the distributed rules all ranks.")
    for note in dropped:
        m.add_load_note(ev, note)
    ev.ranks = rs
    ev.__dict__["trace_data"] = held
    ev.__dict__["snapshot_data"] = []
    return ev, held
