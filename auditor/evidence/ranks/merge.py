"""One Evidence from the `audit run` evidence of several ranks of one job (merge_rank_dirs, which
reduces each rank's directory to its RankSummary as it reads it, the reduction `audit analyze
--engine` runs; merge_runs for evidence already loaded): the primary rank's (rank 0 when present)
with the merged view of all ranks added, the job's root failure as its ending, and notes on ranks
that are missing or ended early. Run directories merge only when
they are distinct ranks of one job (check_one_job): anything else is the usage error of giving
`audit analyze` two runs."""
from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import msgspec

from auditor.evidence import model as m
from auditor.evidence.errors import InputError
from auditor.evidence.ranks.combine import combine, rank_ranges
from auditor.evidence.ranks.engines import EngineSpec, reduce_all
from auditor.evidence.ranks.model import UnreadRank
from auditor.evidence.ranks.runs import RANK_DIR
from auditor.evidence.ranks.summary import RankFailure, RankSummary, RunFacts, reduce_run, summarize_run
from auditor.evidence.store import is_run_dir, load_run_dir


def _relative(path: str, base: Path | None) -> str:
    """`path` relative to the directory the evidence is saved in, else absolute."""
    if base is None:
        return str(Path(path).resolve())
    try:
        return str(Path(path).resolve().relative_to(base.resolve()))
    except ValueError:
        return path


def _launcher_stopped(e: m.Ending) -> bool:
    """Killed by SIGTERM/SIGKILL or interrupted: what a launcher does to the others once one rank fails."""
    return e.status == "interrupted" or (e.status == "crashed" and e.signal in ("SIGTERM", "SIGKILL", "SIGINT"))


_PEER_GONE = ("DistBackendError", "DistNetworkError")
_PEER_GONE_TEXT = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "gloo/", "NCCL")


def _peer_gone(e: m.Ending) -> bool:
    """Raised by a collective because another rank went away (gloo's "Connection closed by peer"):
    a consequence of that rank's failure, whichever process ended first."""
    return e.status == "raised" and (e.exception in _PEER_GONE or any(t in (e.message or "") for t in _PEER_GONE_TEXT))


def _root_failure(runs: list[tuple[int, RunFacts]]) -> tuple[int, RunFacts] | None:
    """The rank whose failure started it: a rank that failed on its own before one a launcher stopped
    or one whose collective lost its peer, then the earliest to end."""
    failed = [(r, f) for r, f in runs if not m.ended_well(f.ending)]
    if not failed:
        return None
    return min(failed, key=lambda p: (_launcher_stopped(p[1].ending), _peer_gone(p[1].ending),
                                      p[1].ended_at or math.inf, p[0]))


def merge_runs(runs: list[tuple[m.Evidence, Path]], world_size: int | None = None,
               out: Path | None = None) -> m.Evidence:
    """One Evidence from the evidence of several ranks (see the module docstring), already loaded.

    `out`: the directory the merged evidence will be saved in; paths under it are stored relative."""
    loaded = {str(p): ev for ev, p in runs}
    return merge_run_summaries([summarize_run(ev, p) for ev, p in runs], world_size, out, load=loaded.__getitem__)


def merge_run_summaries(summaries: list[RankSummary], world_size: int | None = None, out: Path | None = None,
                        load: Callable[[str], m.Evidence] | None = None) -> m.Evidence:
    """One Evidence from the ranks' summaries (auditor.evidence.ranks.summary.reduce_run): the
    primary rank's full evidence, loaded here alone (`load`, else from its directory), with the
    merged view of all ranks; the other ranks are only ever held as their summaries."""
    ranked = sorted(((s.rank if s.rank is not None else i, s) for i, s in enumerate(summaries)), key=lambda t: t[0])
    world_size = world_size or next((s.world_size for _, s in ranked if s.world_size), None)
    parts = [(msgspec.structs.replace(s.info, rank=r, path=_relative(s.path, out)), s.syncs) for r, s in ranked]
    rs = combine(parts, world_size, "run")
    rank0, first = ranked[0]
    primary_path = Path(first.path)
    primary = load(first.path) if load is not None else load_run_dir(primary_path)
    merged = m.decode(m.encode(primary))  # a copy: the rank's own evidence stays as it was
    merged.traces = [_relative(t, out) for t in primary.traces]
    if merged.profile is not None:
        merged.profile.trace_files = [_relative(str(primary_path / t), out) if not Path(t).is_absolute() else t
                                      for t in primary.profile.trace_files]
    facts = [(r, s.run or RunFacts(target="", ending=m.Ending())) for r, s in ranked]
    root = _root_failure(facts)
    if root is not None:
        r, f = root
        merged.ending = msgspec.structs.replace(f.ending, message=f"rank {r}: {f.ending.message or f.ending.status}")
    if rs.missing:
        rs.notes.append(f"no evidence from rank(s) {rank_ranges(rs.missing)} of {world_size}: they did not finish "
                        "writing it, or wrote it on another machine (copy their rank-K/ directories here and run "
                        "`audit analyze DIR`)")
    for r, f in facts:
        e = f.ending
        if r != rank0 and e.status != "completed":
            rs.notes.append(f"rank {r} ended: {e.status}" + (f" in step {e.step}" if e.step is not None else "")
                            + (f" ({e.message})" if e.message else ""))
    merged.environment.notes = [*merged.environment.notes,
                                f"Merged from {len(ranked)} rank(s) ({rank_ranges([r for r, _ in ranked])}"
                                + (f" of {world_size}" if world_size else "") + f"); per-rank rules read rank "
                                f"{rank0}'s evidence, the distributed rules compare all ranks.", *rs.notes]
    merged.ranks = rs
    return merged


def merge_rank_dirs(dirs: list[Path], world_size: int | None = None, out: Path | None = None,
                    engine: EngineSpec | None = None, on_done: Callable | None = None,
                    check: bool = False) -> m.Evidence:
    """The merged Evidence of rank run directories, each reduced to its summary as it is read (on
    `engine`: by default in this process, one at a time), so that only one rank's full evidence
    (the primary's) is held at once. A directory whose evidence cannot be read is listed in
    RankSet.unread and the others merged; none readable raises InputError. `check`: first make
    sure they are the ranks of one job (check_one_job)."""
    results = reduce_all([str(d) for d in dirs], engine or EngineSpec(), on_done, reduce=reduce_run)
    read = [r for r in results if isinstance(r, RankSummary)]
    failed = [r for r in results if isinstance(r, RankFailure)]
    if not read:
        if len(failed) == 1:
            raise InputError(failed[0].reason)
        raise InputError(f"none of the {len(failed)} rank run directories could be read "
                         f"(the first: {failed[0].reason})")
    if check and len(dirs) > 1:
        check_one_job(read)
    merged = merge_run_summaries(read, world_size, out)
    if failed:
        merged.ranks.unread = [UnreadRank(path=f.path, reason=f.reason) for f in failed]
        note = (f"{len(failed)} of {len(results)} rank run directories could not be read and are left out: "
                + "; ".join(f.reason for f in failed[:10]) + (f"; and {len(failed) - 10} more" if len(failed) > 10 else ""))
        merged.ranks.notes.append(note)
        merged.environment.notes.append(note)
    return merged


def find_rank_dirs(path: Path) -> list[Path]:
    """`rank-K/` run directories directly under `path`, in rank order."""
    if not path.is_dir():
        return []
    found = [(int(h.group(1)), p) for p in path.iterdir() if (h := RANK_DIR.match(p.name)) and is_run_dir(p)]
    return [p for _, p in sorted(found)]


def load_rank_dirs(dirs: list[Path], out: Path | None = None, engine: EngineSpec | None = None,
                   on_done: Callable | None = None) -> m.Evidence:
    """The merged Evidence of rank run directories, after checking they are the ranks of one job.
    (One rank-K/ found under a directory: a job's one surviving rank.)"""
    return merge_rank_dirs(dirs, out=out, engine=engine, on_done=on_done, check=True)


ONE_RUN = "only one `audit run` directory can be analyzed at a time"


def _target_key(target: str) -> str:
    """A TARGET as every rank of one job names it: nodes may spell the path to the same file
    differently (relative, absolute), so a file target compares by file name and callable."""
    left, sep, attr = target.rpartition(":")
    if sep and (left.endswith(".py") or "/" in left):
        return f"{Path(left).name}:{attr}"
    return target


def check_one_job(runs: list[RankSummary]) -> None:
    """Raise InputError unless `runs` (summaries of run directories) are distinct ranks of one
    distributed job.

    Why: merging compares the ranks step by step and calls the slowest one a straggler, so two
    unrelated runs (or one directory given twice) merged as "2 ranks" would yield a made-up
    finding. A rank's `audit run` records who it is (Evidence.rank: rank, world size, the
    launcher's run id) and its TARGET; ranks of one job agree on all but the rank, which differs.
    A merged report (`DIR/evidence.json` of a job) is not one more rank either."""
    seen: dict[Path, str] = {}
    for s in runs:
        key = Path(s.path).resolve()
        if key in seen:
            raise InputError(f"{ONE_RUN}: {s.path} is given twice")
        seen[key] = s.path
    first: tuple[RankSummary, int, int] | None = None
    by_rank: dict[int, str] = {}
    for s in runs:
        facts = s.run or RunFacts(target="", ending=m.Ending())
        if facts.merged:
            raise InputError(f"{ONE_RUN}: {s.path} holds the merged report of a distributed run, not one of its "
                             f"ranks (give it alone, or only its rank-K/ directories)")
        rank, world = facts.recorded_rank, s.world_size
        if rank is None or world is None or not 0 <= rank < world:
            raise InputError(f"{ONE_RUN}: {s.path} is not a rank of a distributed run")
        if rank in by_rank:
            raise InputError(f"{ONE_RUN}: {by_rank[rank]} and {s.path} are both rank {rank}")
        by_rank[rank] = s.path
        if first is None:
            first = (s, rank, world)
            continue
        s0, rank0, world0 = first
        f0 = s0.run or facts
        if world != world0:
            raise InputError(f"{ONE_RUN}: {s.path} is rank {rank} of {world}, {s0.path} rank {rank0} of {world0}")
        if f0.run_id is not None and facts.run_id is not None and facts.run_id != f0.run_id:
            raise InputError(f"{ONE_RUN}: {s.path} is rank {rank} of another run than {s0.path} "
                             f"(run id {facts.run_id}, not {f0.run_id})")
        if _target_key(facts.target) != _target_key(f0.target):
            raise InputError(f"{ONE_RUN}: {s.path} audited {facts.target}, {s0.path} audited {f0.target}")
