"""`audit analyze` of a job's per-rank traces: which inputs are the ranks of one job (is_rank_job,
from each file's header alone), their reduction on an engine (auditor.evidence.ranks.engines) and
one Evidence from the summaries (merge_summaries).

The driver of `audit analyze` (EngineSpec.sketch) never holds more than the summaries: the primary
rank's traces (the lowest rank's), which the single-rank trace rules read, are held as their
sketches (auditor.evidence.ranks.sketch), made by the worker that reduces them, and the rules that
read their events run in a process of their own that parses them again (auditor.rules.primary).
A rank whose file cannot be read is listed in RankSet.unread with its reason, and the rest are
analysed; none readable is the input error of a damaged trace (exit 2).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import msgspec

from auditor.evidence import model as m
from auditor.evidence.errors import InputError
from auditor.evidence.ranks.combine import combine, rank_ranges
from auditor.evidence.ranks.engines import EngineSpec, Result, in_child, reduce_all
from auditor.evidence.ranks.model import RankInfo, SyncMap, UnreadRank
from auditor.evidence.ranks.sketch import TraceSketch
from auditor.evidence.ranks.summary import RankFailure, RankSummary, TraceReducer
from auditor.evidence.ranks.traces import MAX_RANKS

# What is read of each file at a time to find its header (a header of 8 GPUs' deviceProperties is
# ~5 KB): the decision reads a few blocks of every rank's file, not a trace's 2 MB chunks.
HEADER_BYTES = 1 << 16
# How many unread ranks the notes name one by one (the rest are counted).
LISTED_UNREAD = 10


def header_rank(path: Path) -> tuple[bool, int | None]:
    """(readable, rank) from a trace file's header, the JSON before its traceEvents (Kineto writes
    distributedInfo there): read without parsing a single event. (False, None): the header cannot
    be read (a damaged file)."""
    from auditor.evidence.trace.decode import _Stream

    stream = _Stream(path, HEADER_BYTES)
    try:
        stream.start()
    except (InputError, OSError, EOFError, ValueError):
        return False, None
    finally:
        if stream.reader is not None:
            stream.reader.close()
    info = stream.header.get("distributedInfo")
    rank = info.get("rank") if isinstance(info, dict) else None
    if isinstance(rank, str) and rank.isdigit() and len(rank) <= 7:
        rank = int(rank)
    ok = isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < MAX_RANKS
    return True, rank if ok else None


def is_rank_job(files: list[Path]) -> bool:
    """Whether trace `files` are per-rank traces of one job: every file whose header can be read
    names a rank there, and they name at least two. (A file that names none, or ranks named only
    after the events, leave the decision to the full parse, as before.)"""
    ranks = set()
    for f in files:
        readable, rank = header_rank(f)
        if readable and rank is None:
            return False
        if rank is not None:
            ranks.add(rank)
    return len(ranks) >= 2


def merge_rank_traces(files: list[Path], spec: EngineSpec,
                      on_done: Callable[[Result, int, int], None] | None = None) -> m.Evidence:
    """The merged Evidence of a job's per-rank trace files, each reduced on `spec`'s engine (with
    EngineSpec.sketch, the primary rank's, by their headers, with their sketches)."""
    primary: frozenset[str] = frozenset()
    if spec.sketch:
        ranked = [(rank, f) for f in files if (rank := header_rank(f)[1]) is not None]
        lowest = min((r for r, _ in ranked), default=None)
        primary = frozenset(str(f) for r, f in ranked if r == lowest)
    results = reduce_all([str(f) for f in files], spec, on_done, reduce=TraceReducer(sketched=primary))
    return merge_summaries(results, sketch=spec.sketch)


def merge_summaries(results: list[Result], load_primary: bool = True, sketch: bool = False) -> m.Evidence:
    """One Evidence from the ranks' summaries: the merged view of every rank read (Evidence.ranks),
    the primary (lowest) rank's traces in `trace_data` (unless `load_primary` is False): parsed
    here, or with `sketch` their sketches (a trace whose summary has none is sketched in a process
    of its own), notes on what was not read. Raises InputError when no rank could be read."""
    read = [r for r in results if isinstance(r, RankSummary)]
    failed = [r for r in results if isinstance(r, RankFailure)]
    nameless = [r for r in read if r.rank is None]
    failed += [RankFailure(path=r.path, reason=f"{r.path}: names no rank in its distributedInfo") for r in nameless]
    read = [r for r in read if r.rank is not None]
    if not read:
        first = failed[0].reason if failed else "no input"
        raise InputError(f"none of the {len(results)} rank traces could be read (the first: {first})")
    by_rank: dict[int, list[RankSummary]] = defaultdict(list)
    world = None
    for s in read:
        by_rank[s.rank].append(s)
        world = world or s.world_size
    parts: list[tuple[RankInfo, SyncMap]] = []
    for rank, pieces in sorted(by_rank.items()):
        first = pieces[0]
        info = msgspec.structs.replace(
            first.info, rank=rank, hostname=next((p.hostname for p in pieces if p.hostname), ""),
            steps=sorted((s for p in pieces for s in p.info.steps), key=lambda s: s.index),
            traces=[t for p in pieces for t in p.info.traces])
        syncs: SyncMap = {}
        for p in pieces:
            syncs.update(p.syncs)
        parts.append((info, syncs))
    rs = combine(parts, world, "trace")
    rs.unread = [UnreadRank(path=f.path, reason=f.reason) for f in failed]
    primary = rs.ranks[0]
    ev = m.Evidence(source="trace", traces=list(primary.traces))
    ev.environment.notes.append(
        f"Merged profiler traces of {len(rs.ranks)} rank(s) ({rank_ranges([r.rank for r in rs.ranks])}"
        + (f" of {rs.world_size}" if rs.world_size else "")
        + f"); trace rules read rank {primary.rank}'s traces, the distributed rules all ranks.")
    if failed:
        listed = "; ".join(f.reason for f in failed[:LISTED_UNREAD])
        more = f"; and {len(failed) - LISTED_UNREAD} more" if len(failed) > LISTED_UNREAD else ""
        rs.notes.append(f"{len(failed)} of {len(results)} rank trace(s) could not be read and are left out: "
                        f"{listed}{more}")
    ev.environment.notes.extend(rs.notes)
    for s in read:
        if s.digest is not None and s.digest.dropped:
            m.add_load_note(ev, f"{Path(s.path).name}: {s.digest.dropped}")
    ev.ranks = rs
    parsed = []
    if load_primary and not sketch:
        from auditor.evidence.trace.load import load_trace

        for path in primary.traces:
            try:
                parsed.append(load_trace(path))
            except InputError as e:  # (it was read by its worker: changed since)
                m.add_load_note(ev, f"profiler trace not analysed: {e}")
    elif load_primary:
        from auditor.evidence.ranks.sketch import sketched

        kept = {s.path: s.sketch for s in read if s.rank == primary.rank and s.sketch is not None}
        missing = [p for p in primary.traces if p not in kept]
        if missing:
            kept.update(zip(missing, in_child(sketch_files, missing)))
        for path in primary.traces:
            if isinstance(kept[path], str):  # (it was read by its worker: changed since)
                m.add_load_note(ev, f"profiler trace not analysed: {kept[path]}")
            else:
                parsed.append(sketched(kept[path]))
    ev.__dict__["trace_data"] = parsed
    ev.__dict__["snapshot_data"] = []
    return ev


def sketch_files(paths: list[str]) -> list[TraceSketch | str]:
    """Each trace's sketch, or the reason it cannot be read (one line)."""
    from auditor.evidence.ranks.sketch import sketch_trace
    from auditor.evidence.trace.load import load_trace

    out: list[TraceSketch | str] = []
    for path in paths:
        try:
            out.append(sketch_trace(load_trace(path)))
        except InputError as e:
            out.append(str(e))
    return out
