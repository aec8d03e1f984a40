"""The typed records of the per-rank view (auditor.evidence.ranks): a RankSet of RankInfo, each
with its RankStep per step and SiteStat per explicit collective site, and the keys under which a
rank's identity and the merged view are stored on an Evidence."""
from __future__ import annotations

import msgspec

from auditor.evidence.frame import Frame

SyncMap = dict[int, dict[str, float]]  # step index -> sync-point key -> ms this rank spent in it


class RankIdentity(msgspec.Struct):
    """Who a rank of a launched job is (Evidence.rank), as its `audit run` process records it from
    the launcher's environment.

    rank, world_size: its rank and the job's; local_rank, local_world_size, node_rank: its place
    on its node (None when the launcher does not say); run_id: the launcher's run id (ranks of one
    job share it; None when unknown); hostname: the machine it ran on; ended_at: when its process
    ended (seconds since the epoch), which orders the ranks' failures."""

    rank: int
    world_size: int
    local_rank: int | None = None
    local_world_size: int | None = None
    node_rank: int | None = None
    run_id: str | None = None
    hostname: str = ""
    ended_at: float | None = None


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
    exposed_ms: float | None = None  # of comm_ms, the device time no other GPU work overlapped (traces with GPU communication)

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

    op: str  # the torch.distributed function
    where: Frame | None  # the user's line
    calls: int = 0  # calls over the run
    steps: int = 0  # steps it ran in
    ms: float = 0.0  # total time in it
    wait_ms: float | None = None  # of ms, the part beyond the fastest rank's (None: one rank only)
    bytes: int = 0  # tensor payload of all calls
    async_calls: int = 0  # calls made with async_op=True


class RankInfo(msgspec.Struct):
    """One rank: who it is, how it ended, its steps and its explicit collectives."""

    rank: int
    source: str = "run"  # run | trace: what it was read from
    path: str = ""  # its run directory or first trace
    hostname: str = ""
    local_rank: int | None = None
    backend: str | None = None  # the process group's backend
    status: str = "completed"  # how its run ended (Ending.status)
    ending_step: int | None = None  # the step it ended in, when it ended early
    message: str | None = None  # what it ended with
    steps: list[RankStep] = []
    sites: list[SiteStat] = []
    phase_sites: dict[str, Frame] = {}  # where each phase's time was spent (largest site)
    traces: list[str] = []  # its profiler traces


class UnreadRank(msgspec.Struct):
    """A rank's input that could not be read (RankSet.unread): its path, and why, in one line."""

    path: str
    reason: str


class RankSet(msgspec.Struct):
    """The ranks of one job, merged (Evidence.ranks)."""

    world_size: int | None  # the job's, when known
    ranks: list[RankInfo]  # in rank order
    missing: list[int] = []  # ranks of the world that gave no evidence
    source: str = "run"  # run | trace: what the ranks were read from
    notes: list[str] = []  # what the reports say about the merge (missing ranks, ranks that ended early)
    unread: list[UnreadRank] = []  # inputs of ranks that could not be read, left out of the merge

    def get(self, rank: int) -> RankInfo | None:
        return next((r for r in self.ranks if r.rank == rank), None)
