"""`audit run` across ranks: launching through PyTorch's elastic launcher, and being one rank of it.

Two ways in, one layout out (`DIR/rank-K/` per rank, the merged report in `DIR/`):
- `audit run TARGET --nproc-per-node N [-- ARGS]` runs `python -m torch.distributed.run --standalone
  --nproc-per-node N -m auditor run TARGET --options-json OPTIONS [-- ARGS]` (TARGET a step callable or a
  whole program: each rank runs the program and finds its own steps). PyTorch's launcher owns the process
  group's life (rendezvous, environment, tearing every rank down when one fails); the auditor never
  spawns ranks itself. Once the launcher returns, every rank has finished writing, so this process
  merges `DIR/rank-*/` and writes the report.
- The user runs `torchrun ... -m auditor run TARGET --out DIR` on one or many nodes. Each rank sees
  RANK / WORLD_SIZE and writes `DIR/rank-K/`. Rank 0 then waits, bounded, for the other ranks'
  evidence and builds the report from every rank present; ranks on machines that do not share DIR
  are merged later with `audit analyze DIR` (or `audit analyze rank-0/ rank-1/ ...`).

A rank's own evidence is written atomically (a temporary file renamed), so rank 0 never reads a
half-written file. When the launcher stops a rank (SIGTERM to its process group after another rank
failed), the rank's `audit run` process keeps going long enough to save what its child streamed.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import click
import msgspec

from auditor.capture.target import MODULE_PREFIX
from auditor.command_options import RunOptions, encode
from auditor.evidence import model as m
from auditor.evidence.ranks.model import RankIdentity
from auditor.evidence.store import EVIDENCE_FILE
from auditor.evidence.whole_files import write_whole

ENV_MERGE = "AUDIT_RANK_MERGE"  # "launcher": the launching process merges, ranks only write
ENV_RUN_ID = "AUDIT_RUN_ID"  # set by the launching `audit run`; else torchrun's TORCHELASTIC_RUN_ID
MARKER = ".audit-run"  # in rank-K/, written after evidence.json: the run id that evidence belongs to
STOPPED_RANK_TIMEOUT_S = 10.0  # a launcher SIGKILLs 30 s after SIGTERM: merge well before that
POLL_S = 0.2


@dataclass(frozen=True)
class RankEnv:
    """This process's place in a launch, from the variables torchrun (or any launcher) sets."""

    rank: int
    world_size: int
    local_rank: int | None = None
    local_world_size: int | None = None
    node_rank: int | None = None
    run_id: str | None = None

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "RankEnv | None":
        env = os.environ if environ is None else environ
        try:
            rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        except (KeyError, ValueError):
            return None

        def opt(key: str) -> int | None:
            v = env.get(key, "")
            return int(v) if v.isdigit() else None

        return cls(rank=rank, world_size=world, local_rank=opt("LOCAL_RANK"),
                   local_world_size=opt("LOCAL_WORLD_SIZE"), node_rank=opt("GROUP_RANK"),
                   run_id=env.get(ENV_RUN_ID) or env.get("TORCHELASTIC_RUN_ID") or None)

    def run_dir(self, root: Path) -> Path:
        return root / f"rank-{self.rank}"

    def merges(self) -> bool:
        """Rank 0 builds the report unless a launching `audit run` will."""
        return self.rank == 0 and os.environ.get(ENV_MERGE) != "launcher"

    def identity(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "local_rank": self.local_rank,
                "local_world_size": self.local_world_size, "node_rank": self.node_rank, "run_id": self.run_id,
                "hostname": socket.gethostname()}


def shared_out(name: str, rank: RankEnv) -> Path:
    """The default output root when ranks run under a launcher: the same on every rank and node
    (a timestamp would differ between processes), from the launcher's run id."""
    suffix = rank.run_id or os.environ.get("MASTER_PORT") or "ranks"
    return Path("audit-out") / f"{name}-{suffix}"


# ---------------------------------------------------------------------------------------------
# The launching side: `audit run --nproc-per-node N`.

def launcher_command(target: str, nproc: int, rank_args: list[str]) -> list[str]:
    """`target` is TARGET as `audit run` takes it; a module program's spec ("-m pkg.mod") is
    given to each rank as its -m option."""
    where = ["-m", target[len(MODULE_PREFIX):]] if target.startswith(MODULE_PREFIX) else [target]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "--max-restarts", "0", "--monitor-interval", "0.5",
            "-m", "auditor", "run", *where, *rank_args]


def launch(target: str, nproc: int, out: Path, rank_args: list[str],
           finish: Callable[[m.Evidence], int]) -> int:
    """Run N ranks under torch.distributed.run, then merge their evidence and report (`finish`).

    Returns the exit code: `finish`'s, or 3 when no rank left any evidence."""
    out.mkdir(parents=True, exist_ok=True)
    run_id = uuid.uuid4().hex
    env = dict(os.environ, **{ENV_MERGE: "launcher", ENV_RUN_ID: run_id})
    proc = subprocess.Popen(launcher_command(target, nproc, rank_args), env=env)
    try:
        rc = proc.wait()
    except KeyboardInterrupt:  # the launcher got the Ctrl-C too and stops its ranks: let it
        try:
            rc = proc.wait(timeout=60)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            proc.kill()
            rc = proc.wait()
    from auditor.evidence.ranks.merge import merge_rank_dirs

    dirs = rank_dirs_of(out, nproc, run_id)
    if not dirs:
        click.echo(f"audit: error: no rank wrote evidence under {out} (torch.distributed.run exited {rc})",
                   err=True)
        return 3
    evidence = merge_rank_dirs(dirs, world_size=nproc, out=out)  # (each rank reduced as it is read)
    if rc != 0 and evidence.ending.status == "completed":
        evidence.ending = m.Ending(status="crashed", returncode=rc,
                                   message=f"torch.distributed.run exited with code {rc}")
    return finish(evidence)


def rank_argv(options: RunOptions, out: Path, script_args: Sequence[str] = ()) -> list[str]:
    """The launching `audit run`'s options, whole, as each rank gets them (--options-json): quiet,
    writing under `out`, launching and showing nothing (rules and reports run once, after the
    merge); then the script's own arguments after `--`. Every rank of a whole program gets the
    same --steps (and --skip): DDP ranks step in lockstep, so each ends at the same step boundary
    and none is left waiting in a collective for a rank that has stopped."""
    rank = msgspec.structs.replace(options, out=out, quiet=True, nproc_per_node=None, verify=False, baseline=None,
                                   open_report=False, tensorboard=False)
    argv = ["--options-json", encode(rank)]
    return [*argv, "--", *script_args] if script_args else argv


# ---------------------------------------------------------------------------------------------
# The rank side: `audit run` under a launcher.

class RankSession:
    """One rank's `audit run`: where it writes, surviving the launcher's SIGTERM, and the merge."""

    def __init__(self, env: RankEnv, root: Path) -> None:
        self.env = env
        self.root = root
        self.stopped = False  # the launcher sent SIGTERM: another rank failed
        for stale in (self.run_dir / MARKER, self.run_dir / EVIDENCE_FILE):  # an earlier run into this DIR
            stale.unlink(missing_ok=True)

    @classmethod
    def from_env(cls, root: Path | None, name: str) -> "RankSession | None":
        env = RankEnv.from_env()
        return None if env is None else cls(env, root or shared_out(name, env))

    @property
    def run_dir(self) -> Path:
        return self.env.run_dir(self.root)

    @contextlib.contextmanager
    def stoppable(self) -> Iterator[None]:
        """While the child runs: a SIGTERM from the launcher (sent to the whole process group, so
        the child gets it too) must not kill this process before it has saved what the child sent."""
        def on_term(signum, frame) -> None:  # the child dies of it, the pipe closes, run_child returns
            self.stopped = True

        old = signal.signal(signal.SIGTERM, on_term)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, old)

    def finish(self, evidence: m.Evidence, timeout_s: float, report: Callable[[m.Evidence, Path], int]) -> int:
        """Save this rank's evidence; on the merging rank, wait (bounded) for the others, merge, report."""
        env = self.env
        with self.stoppable():  # a SIGTERM now only shortens the wait for the other ranks
            evidence.rank = RankIdentity(**env.identity(), ended_at=time.time())
            save_atomic(evidence, self.run_dir)
            write_whole(self.run_dir / MARKER, env.run_id or "")
            status = evidence.ending.status
            click.echo(f"audit: rank {env.rank}: {len(evidence.steps)} step(s), run {status}; "
                       f"evidence in {self.run_dir}")
            if not env.merges():
                return 0 if m.ended_well(evidence.ending) else 3
            from auditor.evidence.ranks.merge import merge_rank_dirs

            dirs = wait_for_ranks(self.root, env.world_size, env.run_id, timeout_s, lambda: self.stopped)
            merged = merge_rank_dirs(dirs, world_size=env.world_size, out=self.root)
            return report(merged, self.root)


def stoppable(session: RankSession | None) -> contextlib.AbstractContextManager:
    """The session's SIGTERM guard, or nothing outside a launch."""
    return session.stoppable() if session is not None else contextlib.nullcontext()


def shows_progress(session: RankSession | None) -> bool:
    """One progress bar per terminal: only rank 0 draws it."""
    return session is None or session.env.rank == 0


def save_atomic(evidence: m.Evidence, run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    return write_whole(run_dir / EVIDENCE_FILE, m.encode(evidence))


def rank_dirs_of(root: Path, world_size: int, run_id: str | None) -> list[Path]:
    """The rank directories under `root` holding this run's evidence (by the marker each rank writes
    last), so a DIR reused from an earlier or a larger run never mixes in stale ranks."""
    from auditor.evidence.ranks.merge import find_rank_dirs

    out = []
    for d in find_rank_dirs(root):
        marker = d / MARKER
        rank = int(d.name.split("-", 1)[1])
        if rank < world_size and marker.is_file() and (run_id is None or marker.read_text() == run_id):
            out.append(d)
    return out


def wait_for_ranks(root: Path, world_size: int, run_id: str | None, timeout_s: float,
                   stopped: Callable[[], bool] = lambda: False) -> list[Path]:
    """This run's rank directories, once all `world_size` are there or `timeout_s` has passed
    (at most STOPPED_RANK_TIMEOUT_S once `stopped()`: the launcher will SIGKILL soon)."""
    start = time.monotonic()
    while True:
        dirs = rank_dirs_of(root, world_size, run_id)
        limit = min(timeout_s, STOPPED_RANK_TIMEOUT_S) if stopped() else timeout_s
        if len(dirs) >= world_size or time.monotonic() - start >= limit:
            return dirs
        time.sleep(POLL_S)
