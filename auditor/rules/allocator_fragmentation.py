"""allocator-fragmentation: reserved GPU memory that is free yet too scattered to serve a request."""
from __future__ import annotations

from typing import Iterable

from auditor.evidence.allocator.analysis import helps, saving_text, simulate_conf
from auditor.evidence.allocator.replay import recorded_figures
from auditor.evidence.allocator.splits import max_split_mb
from auditor.evidence.snapshot import GiB, MemoryFigures, Snapshot, Usage, format_bytes
from auditor.rules._support.alloc_conf import ALLOC_CONF, merge_conf, split_conf
from auditor.rules.base import Option, Options, SnapshotRule
from auditor.findings import Finding, Fix

def _usage_dict(u: Usage) -> dict[str, int]:
    return {"segments": u.segments, "reserved": u.reserved, "allocated": u.allocated, "free": u.free,
            "largest_free": u.largest_free, "free_blocks": u.free_blocks,
            "free_in_empty_segments": u.free_in_empty_segments, "free_in_split_segments": u.free_in_split_segments}


def _simulated(snap: Snapshot, device: int, existing: str,
               choices: list[tuple[dict[str, str], str]]) -> list[tuple[dict[str, str], str]]:
    """With a recorded history, each setting is replayed on the same requests: the ones the
    simulated allocator says do not lower the reserved peak or the cudaFree count are dropped, the
    others quote the simulated saving. Without a history the choices stand as they are."""
    if device not in snap.histories:
        return choices
    recorded = recorded_figures(snap, device)
    out = []
    for settings, why in choices:
        w = simulate_conf(snap, device, merge_conf(existing, **settings))
        if w is None:
            out.append((settings, why))
        elif helps(recorded, w):
            out.append((settings, f"{why} (simulated on the recorded requests: {saving_text(recorded, w)})"))
    return out


class AllocatorFragmentation(SnapshotRule):
    """
    What it detects:
        A CUDA memory snapshot in which much reserved memory is free inside the caching allocator's
        segments, yet scattered: the largest free block is a small part of the free bytes. The
        finding states the free bytes against the reserve and the largest free block, then breaks
        them down: wholly empty cached segments vs holes between live blocks, small vs large pool,
        and per stream (a block freed on one stream is not reused by another).

    Why it costs:
        A request larger than the largest free block cannot use any of the free bytes, so the
        allocator calls cudaMalloc for a new segment. When the device is full it first frees every
        unused cached segment (a device-wide synchronisation, counted as an alloc retry) and tries
        again; if that is still not enough, the step dies with "CUDA out of memory" while the
        message reports gigabytes "reserved but unallocated". Holes between live blocks cannot be
        returned to CUDA at all until their neighbours are freed.

    Example:
        bad:   70.7 GiB reserved, 51.3 GiB allocated, 19.4 GiB free in 710 blocks, largest 314 MiB:
               varying sequence lengths or batch shapes leave segments of many sizes behind
        good:  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: one segment per stream grows and
               shrinks by pages, so free memory stays usable for any request size

    Fix:
        Set PYTORCH_CUDA_ALLOC_CONF, chosen from the snapshot: `expandable_segments:True` unless it
        is already on; with it already on, `garbage_collection_threshold` when the free bytes sit
        in wholly empty segments, and `max_split_size_mb:N` when they sit in holes of split
        large-pool segments (N derived from the sizes of the blocks that split them). Settings the
        program already had are kept.

    Evidence needed:
        A CUDA memory snapshot (`torch.cuda.memory._dump_snapshot()` pickle); no history needed.
    """

    id = "allocator-fragmentation"
    title = "Reserved GPU memory is free but fragmented"
    severity = "warning"
    category = "memory"
    options = (
        Option("min-free-gib", 1.0, "flag only when at least this many GiB are free inside segments"),
        Option("min-free-share", 0.2, "flag only when the free bytes are at least this share of the reserve"),
        Option("max-largest-share", 0.5,
               "flag only when the largest free block is at most this share of the free bytes (scattered)"),
        Option("split-share", 0.5,
               "suggest max_split_size_mb when holes in split large-pool segments hold this share of the free bytes"),
        Option("gc-threshold", 0.8, "the garbage_collection_threshold value to suggest", high=1),
    )

    def check_device(self, snap: Snapshot, device: int, options: Options) -> Iterable[Finding]:
        finding = self._device(snap, device, snap.devices[device], options)
        if finding is not None:
            yield finding

    def _device(self, snap: Snapshot, device: int, fig: MemoryFigures, options: Options) -> Finding | None:
        if fig.reserved == 0 or fig.free == 0:
            return None
        free_share = fig.free / fig.reserved
        largest_share = fig.largest_free / fig.free
        if (fig.free < options.min_free_gib * GiB or free_share < options.min_free_share
                or largest_share > options.max_largest_share):
            return None
        pools = ", ".join(f"{name} pool {format_bytes(u.free)} free of {format_bytes(u.reserved)}"
                          for name, u in fig.by_pool.items())
        streams = ""
        if len(fig.by_stream) > 1:
            streams = "; per stream: " + ", ".join(f"stream {s} {format_bytes(u.free)} free"
                                                   for s, u in fig.by_stream.items())
        message = (
            f"{format_bytes(fig.free)} of the {format_bytes(fig.reserved)} reserved on cuda:{device} "
            f"({free_share:.0%}) is free inside the allocator's segments, yet the largest free block is "
            f"{format_bytes(fig.largest_free)} ({largest_share:.1%} of the free bytes): no request above that "
            f"can use it, so each one forces a new cudaMalloc, a flush-and-retry, or an OOM when the device is "
            f"full. Breakdown: {format_bytes(fig.free_in_empty_segments)} in {fig.empty_segments:,} wholly empty "
            f"segments, {format_bytes(fig.free_in_split_segments)} in holes of {fig.split_segments:,} partly used "
            f"ones; {pools}{streams}.")
        fix, alternatives = self._fix(snap, device, fig, options)
        settings = snap.allocator_settings
        return self.finding(
            ("GPU memory is fragmented: change the allocator's settings. " if fix.config else
             "GPU memory is fragmented: use fewer tensor shapes. ") + message,
            evidence={
                "snapshot": snap.path, "device": device, "reserved": fig.reserved, "allocated": fig.allocated,
                "active": fig.active, "free": fig.free, "free_share": round(free_share, 4),
                "largest_free": fig.largest_free, "largest_free_share": round(largest_share, 4),
                "free_blocks": fig.free_blocks, "segments": fig.segments,
                "empty_segments": fig.empty_segments, "free_in_empty_segments": fig.free_in_empty_segments,
                "split_segments": fig.split_segments, "free_in_split_segments": fig.free_in_split_segments,
                "by_pool": {k: _usage_dict(u) for k, u in fig.by_pool.items()},
                "by_stream": {str(k): _usage_dict(u) for k, u in fig.by_stream.items()},
                "expandable_segments": snap.expandable,
                "alloc_conf": settings.alloc_conf if settings else None,
                "alloc_conf_alternatives": alternatives,
            },
            fix=fix)

    def _fix(self, snap: Snapshot, device: int, fig: MemoryFigures, options: Options) -> tuple[Fix, list[str]]:
        """The allocator setting that addresses what this snapshot shows, plus the fallbacks."""
        settings = snap.allocator_settings
        existing = settings.alloc_conf if settings else ""
        conf = split_conf(existing)
        segs = snap.device_segments(device)
        large = fig.by_pool.get("large", Usage())
        holes_share = large.free_in_split_segments / fig.free
        split_mb = max_split_mb(segs)
        has_split = "max_split_size_mb" in conf or (settings is not None and settings.max_split_size is not None)
        has_gc = "garbage_collection_threshold" in conf or (settings is not None and settings.garbage_collection_threshold > 0)

        choices: list[tuple[dict[str, str], str]] = []
        if not snap.expandable:
            choices.append(({"expandable_segments": "True"},
                            f"the allocator then keeps one segment per stream that grows and shrinks by pages instead of "
                            f"{fig.segments:,} separately sized segments, so free memory can serve any request size"))
        if holes_share >= options.split_share and split_mb is not None and not has_split:
            choices.append(({"max_split_size_mb": str(split_mb)},
                            f"{format_bytes(large.free_in_split_segments)} sits in holes of split large-pool segments; "
                            f"requests under {split_mb} MiB then stop cutting up larger cached blocks"))
        if fig.free_in_empty_segments and not has_gc:
            choices.append(({"garbage_collection_threshold": str(options.gc_threshold)},
                            f"returns the {format_bytes(fig.free_in_empty_segments)} held by {fig.empty_segments} empty "
                            f"segments before a request has to fail and flush the whole cache"))
        choices = _simulated(snap, device, existing, choices)
        if not choices:
            return Fix(summary=(f"The allocator settings already in use ({existing or 'defaults with expandable segments'}) "
                                "leave no further knob; reduce the variety of tensor shapes (pad to a few bucket "
                                "sizes) so freed blocks fit the next requests.")), []
        (first, why), rest = choices[0], choices[1:]
        value = merge_conf(existing, **first)
        alternatives = [merge_conf(existing, **alt) for alt, _ in rest]
        summary = f"Set {ALLOC_CONF}={value}: {why}."
        if rest:
            summary += " Otherwise: " + "; ".join(f"{merge_conf('', **alt)} ({w})" for alt, w in rest) + "."
        return Fix(summary=summary, config={ALLOC_CONF: value}), alternatives
