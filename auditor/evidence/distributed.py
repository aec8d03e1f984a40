"""What the distributed collector (auditor.capture.probes.dist) records about data-parallel training:
per step, the explicit collectives, DDP's gradient syncs and forwards, nn.DataParallel's forwards
(DistStep, in StepRecord.distributed); at the end, the process group and the DDP and DataParallel
modules seen (DistInfo, in Evidence.distributed). Times are wall-clock milliseconds of this rank.
"""
from __future__ import annotations

import msgspec

from auditor.evidence.frame import Frame, recorded_frame


class CallSite(msgspec.Struct, frozen=True):
    """The user's line a call was made at, as the collector records it (no source text)."""

    file: str
    line: int
    function: str = ""



def frame_of(site: CallSite | None) -> Frame | None:
    """The Frame of a recorded call site, with its source line when the file is on this disk
    (None when none was recorded)."""
    return recorded_frame(site) if site is not None else None


class Collective(msgspec.Struct):
    """An explicit collective (`dist.all_reduce(loss)`, `dist.barrier()`) at one user line, in one step.

    op: the torch.distributed function; where: the user's line; calls: how often it ran in the step;
    ms: the wall time of each call (the first MAX_CALL_TIMES), kept one by one so ranks can be
    compared call by call; total_ms: their sum; bytes: the tensor payload of all calls;
    async_calls: calls made with async_op=True (their time is the launch only)."""

    op: str
    where: CallSite | None = None
    calls: int = 0
    ms: list[float] = []
    total_ms: float = 0.0
    bytes: int = 0
    async_calls: int = 0


class BackwardSync(msgspec.Struct):
    """One backward pass through a DDP module.

    ddp: the DDP module's index (DdpConfig.index); synced: whether DDP all-reduced its gradients
    (False under no_sync()); sync_ms: from the last local gradient being ready to the end of
    backward, i.e. this rank's time in the gradient sync (transfer and waiting)."""

    ddp: int
    synced: bool = True
    sync_ms: float = 0.0


class DdpForward(msgspec.Struct):
    """The forward calls of one DDP module in one step.

    ddp: the module's index; calls: forward calls; synced: of those, how many will sync gradients
    (not under no_sync(), grad enabled); ms: their total time; buffer_sync_ms / buffer_syncs: time
    in and number of DDP's buffer broadcasts (`_sync_buffers`); post_forward_ms: time in its
    unused-parameter search (`_post_forward`)."""

    ddp: int
    calls: int = 0
    synced: int = 0
    ms: float = 0.0
    buffer_sync_ms: float = 0.0
    buffer_syncs: int = 0
    post_forward_ms: float = 0.0


class DpForward(msgspec.Struct):
    """The forward calls of one nn.DataParallel module in one step: dp (its index,
    DataParallelInfo.index), calls, ms (their total time)."""

    dp: int
    calls: int = 0
    ms: float = 0.0


class DistStep(msgspec.Struct):
    """One step's distributed activity (StepRecord.distributed).

    collectives: explicit collectives by user line; backward_syncs: DDP backward passes in order;
    ddp_forwards / dp_forwards: forward calls per DDP / DataParallel module; no_sync_entries: how
    often DDP.no_sync() was entered; buffers_changed: per DDP index (as a string), whether any
    module buffer changed in the step (its version counter); params_with_grad: per DDP index (as a
    string), how many parameters received a gradient."""

    collectives: list[Collective] = []
    backward_syncs: list[BackwardSync] = []
    ddp_forwards: list[DdpForward] = []
    dp_forwards: list[DpForward] = []
    no_sync_entries: int = 0
    buffers_changed: dict[str, bool] = {}
    params_with_grad: dict[str, int] = {}


class DdpConfig(msgspec.Struct):
    """One DistributedDataParallel module as constructed, and as DDP reported itself after running.

    index: its order of construction; where: the user's line that built it; given: the DDP
    keyword arguments the user passed, as repr strings; find_unused_parameters,
    gradient_as_bucket_view, static_graph, broadcast_buffers: the settings in force;
    broadcast_kwarg: the name this torch gives the buffer-broadcast argument (broadcast_buffers or
    forward_sync_buffers); bucket_cap_bytes: the bucket size cap; bucket_cap_mb_given: the
    bucket_cap_mb the user passed (None: not passed); params, grad_bytes, largest_grad_bytes: the
    parameters that require gradients, their gradients' total and largest size; buffers,
    buffer_bytes: the module's buffers; device: DDP's device.
    From DDP's logging data after the run (absent when torch does not provide it): bucket_sizes
    (the rebuilt bucket layout, in parameters), unused_parameter_size, comm_hook (the
    registered communication hook's name), static_graph_runtime."""

    index: int
    where: CallSite | None = None
    given: dict[str, str] = {}
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    broadcast_buffers: bool = True
    broadcast_kwarg: str = "broadcast_buffers"
    bucket_cap_bytes: int = 25 * 2**20
    bucket_cap_mb_given: int | float | None = None
    params: int = 0
    grad_bytes: int = 0
    largest_grad_bytes: int = 0
    buffers: int = 0
    buffer_bytes: int = 0
    device: str = ""
    bucket_sizes: list[int] = []
    unused_parameter_size: int | None = None
    comm_hook: str | None = None
    static_graph_runtime: bool = False


class DataParallelInfo(msgspec.Struct):
    """One nn.DataParallel module as constructed: index (order of construction), where (the
    user's line), device_ids (the GPUs it splits batches over), module (the wrapped module's
    class), cuda_devices (the GPUs the process could see)."""

    index: int
    where: CallSite | None = None
    device_ids: list[int] = []
    module: str = ""
    cuda_devices: int = 0


class DistInfo(msgspec.Struct):
    """The distributed setup a run saw (Evidence.distributed).

    initialized: whether a process group was up at the end; rank, world_size, local_rank,
    local_world_size, group_rank: from the process group when initialized, else from the launcher's
    environment variables (RANK, ... as ints, or the text when not a number; None: not set);
    backend: the process group's backend; ddp: the DDP modules built; data_parallel: the
    nn.DataParallel modules built."""

    initialized: bool = False
    rank: int | str | None = None
    world_size: int | str | None = None
    local_rank: int | str | None = None
    local_world_size: int | str | None = None
    group_rank: int | str | None = None
    backend: str | None = None
    ddp: list[DdpConfig] = []
    data_parallel: list[DataParallelInfo] = []
