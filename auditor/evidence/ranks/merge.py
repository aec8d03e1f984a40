"""One Evidence from the `audit run` evidence of several ranks of one job (merge_runs): the primary
rank's (rank 0 when present) with the merged view of all ranks added, the job's root failure as
its ending, and notes on ranks that are missing or ended early. Run directories merge only when
they are distinct ranks of one job (check_one_job): anything else is the usage error of giving
`audit analyze` two runs."""
from __future__ import annotations

import math
from pathlib import Path

import msgspec

from auditor.evidence import model as m
from auditor.evidence.errors import InputError
from auditor.evidence.ranks.combine import combine, rank_ranges
from auditor.evidence.ranks.runs import RANK_DIR, info_from_run, rank_of, world_size_of
from auditor.evidence.store import is_run_dir, load_run_dir


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
                                      (p[1].rank.ended_at if p[1].rank is not None else None) or math.inf, p[0]))


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
    merged.ranks = rs
    return merged


def find_rank_dirs(path: Path) -> list[Path]:
    """`rank-K/` run directories directly under `path`, in rank order."""
    if not path.is_dir():
        return []
    found = [(int(h.group(1)), p) for p in path.iterdir() if (h := RANK_DIR.match(p.name)) and is_run_dir(p)]
    return [p for _, p in sorted(found)]


def load_rank_dirs(dirs: list[Path], out: Path | None = None) -> m.Evidence:
    """The merged Evidence of rank run directories, after checking they are the ranks of one job."""
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
    finding. A rank's `audit run` records who it is (Evidence.rank: rank, world size, the
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
        if ev.ranks is not None:
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
        run0, run = (e.rank.run_id if e.rank is not None else None for e in (ev0, ev))
        if world != world0:
            raise InputError(f"{ONE_RUN}: {path} is rank {rank} of {world}, {path0} rank {rank0} of {world0}")
        if run0 is not None and run is not None and run != run0:
            raise InputError(f"{ONE_RUN}: {path} is rank {rank} of another run than {path0} "
                             f"(run id {run}, not {run0})")
        if _target_key(ev.target) != _target_key(ev0.target):
            raise InputError(f"{ONE_RUN}: {path} audited {ev.target}, {path0} audited {ev0.target}")
