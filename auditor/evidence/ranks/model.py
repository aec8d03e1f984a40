"""The typed records of the per-rank view (auditor.evidence.ranks): a RankSet of RankInfo, each
with its RankStep per step and SiteStat per explicit collective site, and the keys under which a
rank's identity and the merged view are stored on an Evidence."""
from __future__ import annotations

import msgspec

from auditor.evidence.frame import Frame

RANKS_KEY = "ranks"  # the merged view of all ranks (RankSet)
RANK_KEY = "rank"  # the identity a rank's `audit run` process adds to its own evidence

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
    where: Frame | None
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
    phase_sites: dict[str, Frame] = {}  # where each phase's time was spent (largest site)
    traces: list[str] = []


class RankSet(msgspec.Struct):
    world_size: int | None
    ranks: list[RankInfo]
    missing: list[int] = []
    source: str = "run"
    notes: list[str] = []

    def get(self, rank: int) -> RankInfo | None:
        return next((r for r in self.ranks if r.rank == rank), None)
