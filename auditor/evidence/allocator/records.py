"""What a replay of a snapshot's requests through the simulated allocator reports (the `allocator`
section of findings.json; see the README's findings.json contract)."""
from __future__ import annotations

import msgspec


class Figures(msgspec.Struct):
    """The allocator's figures over a trace: recorded (what the allocator wrote) or replayed."""

    reserved_peak_bytes: int
    allocated_peak_bytes: int  # requested bytes of live allocations at their peak (as the history counts)
    segment_allocs: int  # cudaMalloc calls, or page mappings with expandable segments
    segment_frees: int  # cudaFree calls, or page unmappings


class ReplayError(msgspec.Struct):
    """How far the replay under the recorded settings lands from the recording."""

    reserved_peak_pct: float | None  # (replayed - recorded) / recorded reserved peak, percent; None: none recorded
    reserved_max_diff_bytes: int  # the largest |replayed - recorded| reserve after any trace entry
    reserved_mean_diff_bytes: int  # the mean of |replayed - recorded| over the trace entries
    segment_allocs_diff: int  # replayed - recorded
    segment_frees_diff: int


class WhatIf(msgspec.Struct):
    """The same requests under another PYTORCH_CUDA_ALLOC_CONF."""

    alloc_conf: str
    reserved_peak_bytes: int
    segment_allocs: int
    segment_frees: int
    largest_free_block_bytes: int  # the biggest cached block when the trace ends
    retries: int = 0  # times the device was full and the whole cache was released to retry
    ooms: int = 0  # requests that failed even after that
    note: str = ""  # what else the setting needs (e.g. a memory fraction for the garbage collection)


class Churn(msgspec.Struct):
    """One time the allocator hit the device's limit and freed its cache to retry a request."""

    index: int  # trace entry of the request
    requested_bytes: int
    stream: int
    segments_freed: int  # cudaFree calls (or unmappings) in the burst
    bytes_freed: int
    time_us: int | None = None
    file: str = ""  # the user's line behind the request, when the trace has stacks
    line: int = 0
    function: str = ""
    recorded: bool = True  # seen in the recording (an oom entry or a segment_free burst) vs only simulated


class Release(msgspec.Struct):
    """One call of the program's torch.cuda.empty_cache() in the recording: the cached segments it
    returned to CUDA, and the segments the allocator cudaMalloc'd again before the next such call
    (or the trace's end)."""

    index: int  # trace entry of its first segment_free
    segments_freed: int
    bytes_freed: int
    segments_regrown: int  # segment_alloc / segment_map after it
    bytes_regrown: int
    time_us: int | None = None
    file: str = ""  # the user's line that called it, when the trace has stacks
    line: int = 0
    function: str = ""


class StepPeak(msgspec.Struct):
    """The replay's reserve within one step (steps end at the snapshot's Optimizer.step annotations;
    the last step runs to the trace's end)."""

    step: int
    reserved_peak_bytes: int
    first_index: int  # trace entries of the step
    last_index: int


class AllocatorReport(msgspec.Struct):
    """A snapshot's requests replayed through the simulator (auditor.evidence.allocator.replay)."""

    device: int
    capacity_bytes: int
    capacity_source: str  # "given", "oom record", "oom entry", or "assumed: <model>" (smallest usual size >= peak)
    alloc_conf: str  # the recorded settings as a PYTORCH_CUDA_ALLOC_CONF ("" = defaults)
    entries: int  # trace entries replayed
    seeded_segments: int  # segments that existed before the trace began (see replay.seed)
    seeded_blocks: int
    recorded: Figures
    replayed: Figures
    error: ReplayError
    what_if: list[WhatIf] = []
    churn: list[Churn] = []  # recorded churn (or simulated, when the recording shows none but the replay does)
    releases: list[Release] = []  # the program's empty_cache() calls the trace recorded
    without_releases: Figures | None = None  # the replay as if the program had not called them
    per_step: list[StepPeak] = []  # the replayed reserve's peak per step, when the snapshot marks steps
    replay_ms: float = 0.0  # wall time of the replay under the recorded settings
    notes: list[str] = []
