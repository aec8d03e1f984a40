"""The max_split_size_mb a snapshot's split large-pool segments suggest (shared by the
allocator-fragmentation rule's fix and the allocator what-ifs)."""
from __future__ import annotations

import math
from statistics import quantiles

from auditor.evidence.snapshot import MiB, Segment, Snapshot

# The caching allocator's own constants (c10/cuda/CUDACachingAllocator.cpp): requests under 10 MiB
# get a 20 MiB segment, larger ones a segment rounded up to 2 MiB; max_split_size_mb must exceed 20.
_SMALL_REQUEST = 10 * MiB
_SMALL_SEGMENT = 20 * MiB
_ROUND_LARGE = 2 * MiB
_MIN_SPLIT_MB = 21


def max_split_mb(segments: list[Segment]) -> int | None:
    """A max_split_size_mb for the split large-pool segments: just above the segment that the
    common request carving them (90th percentile of their live blocks) is given. Requests below
    it keep reusing segments of their own size; cached blocks at or above it are never cut up by
    them, so they stay whole for large requests. None when nothing is split."""
    carving = [b.requested_size for s in segments if s.segment_type == "large" and s.free_size and s.active_size
               for b in s.blocks if b.live]
    if not carving:
        return None
    p90 = quantiles(carving, n=10)[-1] if len(carving) > 1 else carving[0]
    seg = _SMALL_SEGMENT if p90 < _SMALL_REQUEST else math.ceil(p90 / _ROUND_LARGE) * _ROUND_LARGE
    return max(_MIN_SPLIT_MB, seg // MiB + 1)


def split_mb_for(snapshot: Snapshot, device: int) -> int | None:
    return max_split_mb(snapshot.device_segments(device))
