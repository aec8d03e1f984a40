"""One rank's recording reduced where it is read: a RankSummary, small and typed, is all that travels
from the process (or cluster worker) that parsed a rank's trace to the driver that merges the ranks
(auditor.evidence.ranks.engines runs reduce_trace on a process pool, Ray or Dask; reduce_run does
the same for a rank's `audit run` directory).

Why: a job of hundreds of ranks leaves hundreds of traces of up to gigabytes each. Parsed, one
trace takes about three times its size in memory; a RankSummary of the same rank takes a few
kilobytes per step (its steps, phases and the time of each sync point, which is what the rank rules
compare), so the driver's memory grows with the number of ranks, not with the traces' sizes.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import msgspec

from auditor.evidence import model as m
from auditor.evidence.ranks.model import RankInfo, SyncMap
from auditor.evidence.ranks.sketch import TraceSketch


class TraceDigest(msgspec.Struct):
    """What a rank's trace holds besides its steps, counted where it was parsed.

    events: timed events read; steps: its steps; steps_from: how the steps were told for a trace
    without ProfilerSteps (Trace.steps_from), else None; dropped: the sentence on events left out
    for fields of the wrong type (empty: none); host_syncs: runtime/driver calls during which the
    host waited for the GPU (auditor.evidence.trace.queries.blocking_calls); copies, copy_bytes:
    GPU memcpy rows and their bytes; comm_kernels, comm_ms: communication kernels (NCCL/RCCL) and
    their total device time in ms; exposed_comm_ms: the part of comm_ms during which no other GPU
    work ran (communication that compute did not hide); devices: the GPU names its
    deviceProperties list; torch_version: as the trace states it (empty: none)."""

    events: int = 0
    steps: int = 0
    steps_from: str | None = None
    dropped: str = ""
    host_syncs: int = 0
    copies: int = 0
    copy_bytes: int = 0
    comm_kernels: int = 0
    comm_ms: float = 0.0
    exposed_comm_ms: float = 0.0
    devices: list[str] = []
    torch_version: str = ""


class RunFacts(msgspec.Struct):
    """What merging `audit run` ranks reads of a rank besides its steps: target (its TARGET),
    run_id (the launcher's, None when unknown), ending (how it ended), ended_at (when its process
    ended, seconds since the epoch), merged (its evidence is itself a merged report of ranks),
    recorded_rank: the rank its evidence records (None: none; RankSummary.rank may also come from
    its `rank-K` directory's name)."""

    target: str
    ending: m.Ending
    recorded_rank: int | None = None
    run_id: str | None = None
    ended_at: float | None = None
    merged: bool = False


class RankSummary(msgspec.Struct):
    """One rank's trace (or run directory) reduced to what the merge and the rank rules read.

    path: the file or directory read; rank, world_size: as its distributedInfo (or its run) names
    them, None when it names none; hostname: the machine it ran on, as the recording states it
    (empty: not recorded); info: its steps with their phases and communication (RankInfo, as
    auditor.evidence.ranks.traces / runs make it); syncs: the ms it spent in each sync point, by
    step (what combine compares across ranks); digest: counts of the trace (None for a run
    directory); run: a run directory's facts (None for a trace); bytes: the size of what was read;
    seconds: how long reading and reducing took; sketch: the trace as the driver's reports read
    it (auditor.evidence.ranks.sketch), made for the primary rank alone (None for the others)."""

    path: str
    rank: int | None
    world_size: int | None
    hostname: str
    info: RankInfo
    syncs: SyncMap
    digest: TraceDigest | None = None
    run: RunFacts | None = None
    bytes: int = 0
    seconds: float = 0.0
    sketch: TraceSketch | None = None


class RankFailure(msgspec.Struct):
    """A rank's input that could not be read, and why (the one-line reason an InputError gives)."""

    path: str
    reason: str


# Metadata keys a trace may carry its machine's name under: Kineto writes none; a harness or
# `prof.add_metadata("hostname", ...)` may, at the top level or in distributedInfo.
_HOST_KEYS = ("hostname", "host_name", "hostName", "host", "node", "nodename")


def trace_hostname(metadata: dict) -> str:
    """The machine a trace was recorded on, as its metadata states it; empty when it does not."""
    for where in (metadata, metadata.get("distributedInfo")):
        if isinstance(where, dict):
            for key in _HOST_KEYS:
                value = where.get(key)
                if isinstance(value, str) and value.strip() and len(value) <= 255:
                    return value.strip()
    return ""


# A process decodes one trace at a time: the decoder resizes buffers that a thread's memoryviews may
# still export (BufferError under a dask worker running several threads). Ranks run in parallel as
# processes (a pool's, a cluster's workers), each a core's worth of decoding.
_ONE_AT_A_TIME = threading.Lock()


def reduce_trace(path: str, workers: int | None = 0, sketch: bool = False) -> RankSummary | RankFailure:
    """Parse one rank's trace and reduce it to a RankSummary; a RankFailure when it cannot be read.

    `workers`: processes that decode the file (auditor.evidence.trace.load.load_trace); 0 parses
    in this process, which is right when ranks are already reduced in parallel, one per core.
    `sketch`: also keep the trace's sketch (RankSummary.sketch), as the primary rank's is kept."""
    from auditor.evidence.errors import InputError
    from auditor.evidence.ranks.traces import info_from_traces, trace_rank, trace_world_size
    from auditor.evidence.trace.load import load_trace

    started = time.perf_counter()
    try:
        with _ONE_AT_A_TIME:
            trace = load_trace(path, workers=workers)
    except InputError as e:
        return RankFailure(path=str(path), reason=str(e))
    except (OSError, MemoryError, ValueError) as e:
        return RankFailure(path=str(path), reason=f"{path}: {type(e).__name__}: {e}")
    rank = trace_rank(trace)
    info, syncs = info_from_traces([trace], rank if rank is not None else -1)
    host = trace_hostname(trace.metadata)
    info = msgspec.structs.replace(info, hostname=host)
    digest = _digest(trace)
    kept = None
    if sketch:
        from auditor.evidence.ranks.sketch import sketch_trace

        kept = sketch_trace(trace)
    return RankSummary(path=str(path), rank=rank, world_size=trace_world_size(trace), hostname=host, info=info,
                       syncs=syncs, digest=digest, bytes=_size(path), seconds=round(time.perf_counter() - started, 4),
                       sketch=kept)


class TraceReducer(msgspec.Struct, frozen=True):
    """reduce_trace as an engine runs it on each rank's trace: `sketched` names the traces (the
    primary rank's) whose sketch is kept too. (A Struct: it travels to the workers by pickle.)"""

    sketched: frozenset[str] = frozenset()

    def __call__(self, path: str) -> RankSummary | RankFailure:
        return reduce_trace(path, sketch=str(path) in self.sketched)


def summarize_run(ev: m.Evidence, path: str | Path, seconds: float = 0.0) -> RankSummary:
    """A rank's `audit run` evidence reduced as a trace is (its steps, phases and sync points)."""
    from auditor.evidence.ranks.runs import info_from_run, rank_of, world_size_of

    rank = rank_of(ev, Path(path))
    info, syncs = info_from_run(ev, rank if rank is not None else -1, str(path))
    facts = RunFacts(target=ev.target, ending=ev.ending, recorded_rank=rank_of(ev), run_id=ev.rank.run_id if ev.rank is not None else None,
                     ended_at=ev.rank.ended_at if ev.rank is not None else None, merged=ev.ranks is not None)
    return RankSummary(path=str(path), rank=rank, world_size=world_size_of(ev), hostname=ev.environment.hostname,
                       info=info, syncs=syncs, run=facts, seconds=seconds)


def reduce_run(path: str) -> RankSummary | RankFailure:
    """Load one rank's `audit run` directory and reduce it (summarize_run); a RankFailure when its
    evidence cannot be read."""
    from auditor.evidence.errors import InputError
    from auditor.evidence.store import EVIDENCE_FILE, load_run_dir

    started = time.perf_counter()
    try:
        ev = load_run_dir(Path(path))
    except InputError as e:
        return RankFailure(path=str(path), reason=str(e))
    summary = summarize_run(ev, path, round(time.perf_counter() - started, 4))
    return msgspec.structs.replace(summary, bytes=_size(Path(path) / EVIDENCE_FILE))


def _size(path: str | Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _digest(trace) -> TraceDigest:
    """The trace's counts (TraceDigest), from its columns."""
    import numpy as np

    from auditor.evidence.ranks.traces import COMM_KERNEL
    from auditor.evidence.trace.decode import CAT, GPU_WORK
    from auditor.evidence.trace.intervals import intersect, merge_intervals, total_length
    from auditor.evidence.trace.queries import blocking_calls

    cat = trace.col("cat")
    copies = cat == CAT["memcpy"]
    nbytes = trace.col("bytes")[copies]
    kernels = trace.of("kernel")
    comm = trace.matching(COMM_KERNEL, kernels)
    comm_ms = float(comm["dur"].sum()) / 1e3
    exposed = 0.0
    if len(comm):
        gpu = np.isin(cat, GPU_WORK)
        others = gpu.copy()
        others[comm.index.to_numpy()] = False
        busy = merge_intervals(trace.col("ts")[others], trace.col("end")[others])
        spans = merge_intervals(comm["ts"].to_numpy(), comm["end"].to_numpy())
        exposed = (total_length(spans) - total_length(intersect(spans, busy))) / 1e3
    props = trace.device_properties
    return TraceDigest(events=len(trace.events), steps=len(trace.steps), steps_from=trace.steps_from,
                       dropped=trace.dropped, host_syncs=int(len(blocking_calls(trace))),
                       copies=int(copies.sum()), copy_bytes=int(nbytes[nbytes > 0].sum()),
                       comm_kernels=len(comm), comm_ms=round(comm_ms, 4), exposed_comm_ms=round(exposed, 4),
                       devices=sorted({str(p.get("name", "")) for p in props if p.get("name")}),
                       torch_version=trace.torch_version or "")
