"""The caching allocator's settings as the simulator reads them, and its size rounding.

Constants and rules follow c10/cuda/CUDACachingAllocator.cpp and CUDAAllocatorConfig.cpp:
requests round up to 512 B (or to a power-of-two division when `roundup_power2_divisions` covers
their size), requests up to 1 MiB use the small pool and 2 MiB segments, larger requests under
10 MiB get a 20 MiB segment, larger ones a segment rounded up to 2 MiB.
"""
from __future__ import annotations

import re
from typing import Any

import msgspec

K_MIN_BLOCK = 512  # every size is rounded up to a multiple of this
K_SMALL_SIZE = 1 << 20  # the largest "small" request: 1 MiB
K_SMALL_BUFFER = 2 << 20  # small requests are packed into 2 MiB segments
K_LARGE_BUFFER = 20 << 20  # requests between 1 and 10 MiB share a 20 MiB segment
K_MIN_LARGE_ALLOC = 10 << 20
K_ROUND_LARGE = 2 << 20  # larger segments are rounded up to 2 MiB
INTERVALS = 16  # roundup_power2_divisions has one entry per power of two from 1 MiB to 32 GiB (and above)
MB = 1 << 20


class ConfError(ValueError):
    """A PYTORCH_CUDA_ALLOC_CONF the allocator itself would refuse."""


class AllocatorConfig(msgspec.Struct, frozen=True):
    """The settings a simulated allocator runs under."""

    max_split_size: int | None = None  # bytes; None: unlimited (blocks of any size may be split)
    roundup_power2_divisions: tuple[int, ...] = (0,) * INTERVALS  # per power-of-two interval from 1 MiB
    garbage_collection_threshold: float = 0.0  # fraction of the allowed memory; 0: off
    expandable_segments: bool = False
    # set_per_process_memory_fraction: the allowed memory is this share of the capacity; None: not set.
    # torch runs the garbage collection only when a fraction is set.
    memory_fraction: float | None = None

    def divisions_for(self, size: int) -> int:
        """CUDAAllocatorConfig::roundup_power2_divisions(size): the entry of size's interval."""
        log_size = size.bit_length() - 1
        index = log_size - 20 if log_size > 20 else 0
        return self.roundup_power2_divisions[min(index, INTERVALS - 1)]

    @property
    def split_limit(self) -> int:
        """max_split_size in bytes, SIZE_MAX when unlimited."""
        return self.max_split_size if self.max_split_size is not None else (1 << 64) - 1

    def alloc_conf(self) -> str:
        """The PYTORCH_CUDA_ALLOC_CONF that selects these settings ("" for the defaults)."""
        parts = []
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.max_split_size is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size // MB}")
        if self.garbage_collection_threshold > 0:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold:g}")
        divs = self.roundup_power2_divisions
        if any(divs):
            if len(set(divs)) == 1:
                parts.append(f"roundup_power2_divisions:{divs[0]}")
            else:
                parts.append("roundup_power2_divisions:[" + ",".join(
                    f"{1 << i}:{d}" for i, d in enumerate(divs) if d) + "]")
        return ",".join(parts)


def _items(conf: str) -> list[tuple[str, str]]:
    out = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", conf or ""):
        key, _, value = item.strip().partition(":")
        if key.strip():
            out.append((key.strip(), value.strip()))
    return out


def _divisions(value: str) -> tuple[int, ...]:
    divs = [0] * INTERVALS
    if value.startswith("["):
        last = 0
        for part in value.strip("[]").split(","):
            k, _, v = part.partition(":")
            d = int(v)
            if k.strip() == ">":
                divs[last:] = [d] * (INTERVALS - last)
                continue
            mb = int(k)
            if mb <= 0 or mb & (mb - 1):
                raise ConfError(f"roundup_power2_divisions: {mb} is not a power of two")
            idx = min(mb.bit_length() - 1, INTERVALS - 1)
            divs[last:idx + 1] = [d] * (idx + 1 - last)
            last = idx + 1
    else:
        d = int(value)
        divs = [d] * INTERVALS
    for d in divs:
        if d and d & (d - 1):
            raise ConfError(f"roundup_power2_divisions: {d} is not a power of two")
    return tuple(divs)


def parse_alloc_conf(conf: str, base: AllocatorConfig | None = None) -> AllocatorConfig:
    """Settings from a PYTORCH_CUDA_ALLOC_CONF string, over `base` (defaults when None).
    Keys the simulator does not model (pinned_*, release_lock_on_cudamalloc, backend) are ignored."""
    cfg = base or AllocatorConfig()
    changes: dict[str, Any] = {}
    try:
        for key, value in _items(conf):
            if key == "max_split_size_mb":
                mb = int(value)
                if mb <= K_LARGE_BUFFER // MB:
                    raise ConfError(f"max_split_size_mb must exceed {K_LARGE_BUFFER // MB}, got {mb}")
                changes["max_split_size"] = mb * MB
            elif key == "garbage_collection_threshold":
                t = float(value)
                if not 0.0 < t < 1.0:
                    raise ConfError("garbage_collection_threshold must be between 0 and 1")
                changes["garbage_collection_threshold"] = t
            elif key == "expandable_segments":
                changes["expandable_segments"] = value.lower() in ("true", "1")
            elif key == "roundup_power2_divisions":
                changes["roundup_power2_divisions"] = _divisions(value)
    except ValueError as e:
        raise ConfError(str(e) if isinstance(e, ConfError) else f"unreadable value in {conf!r}") from None
    return msgspec.structs.replace(cfg, **changes)


def from_settings(raw: dict[str, Any] | None) -> AllocatorConfig:
    """The settings a snapshot recorded (`allocator_settings`); the defaults for older snapshots."""
    if not raw:
        return AllocatorConfig()
    mss = raw.get("max_split_size")
    mss = mss if isinstance(mss, int) and 0 < mss < (1 << 62) else None
    gc = raw.get("garbage_collection_threshold")
    gc = float(gc) if isinstance(gc, (int, float)) and 0 < gc < 1 else 0.0
    rd = raw.get("roundup_power2_divisions")
    divs: tuple[int, ...] = (0,) * INTERVALS
    if isinstance(rd, dict):  # keyed by the interval's start in MiB, in order
        vals = [v if isinstance(v, int) else 0 for _, v in sorted(
            ((int(k), v) for k, v in rd.items() if str(k).isdigit()), key=lambda kv: kv[0])]
        divs = tuple((vals + [0] * INTERVALS)[:INTERVALS])
    elif isinstance(rd, (list, tuple)):
        divs = tuple(([v if isinstance(v, int) else 0 for v in rd] + [0] * INTERVALS)[:INTERVALS])
    return AllocatorConfig(max_split_size=mss, roundup_power2_divisions=divs, garbage_collection_threshold=gc,
                           expandable_segments=bool(raw.get("expandable_segments", False)))


def roundup_power2_next_division(size: int, divisions: int) -> int:
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


def round_size(size: int, cfg: AllocatorConfig) -> int:
    """The block size a request of `size` bytes gets (DeviceCachingAllocator::round_size)."""
    if size < K_MIN_BLOCK:
        return K_MIN_BLOCK
    divisions = cfg.divisions_for(size)
    if divisions > 1 and size > K_MIN_BLOCK * divisions:
        return roundup_power2_next_division(size, divisions)
    return K_MIN_BLOCK * ((size + K_MIN_BLOCK - 1) // K_MIN_BLOCK)


def allocation_size(size: int) -> int:
    """The segment cudaMalloc is asked for when no cached block fits (get_allocation_size)."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)
