"""reserved-overhang: GPU memory reserved by the caching allocator but unused for a long stretch."""
from __future__ import annotations

from typing import Iterable

from auditor.evidence.allocator.analysis import simulate_conf
from auditor.evidence.allocator.replay import recorded_figures
from auditor.evidence.snapshot import ALLOC, FREE_COMPLETED, GiB, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, \
    SEGMENT_UNMAP, Snapshot, format_bytes
from auditor.rules._support.alloc_conf import ALLOC_CONF, merge_conf
from auditor.rules.base import Option, Options, SnapshotRule
from auditor.findings import Finding, Fix


def overhang_stretch(snap: Snapshot, device: int, min_bytes: int) -> tuple[int, int, int, int, int] | None:
    """The longest stretch of the trace's time in which reserved minus allocated (requested bytes)
    stayed at or above `min_bytes`: (start_us, end_us, least overhang in it, first index, last index).
    The stretch runs to the last entry when it is still open there."""
    h = snap.histories.get(device)
    trace = snap.device_traces[device]
    if h is None or not trace:
        return None
    reserved, allocated = h.start_reserved, h.start_allocated
    live: dict[int, int] = {}
    best = None
    start = None
    low = 0
    for i, e in enumerate(trace):
        a = e.action
        if a == ALLOC and e.addr is not None:
            allocated += e.size - live.get(e.addr, 0)
            live[e.addr] = e.size
        elif a == FREE_COMPLETED and e.addr is not None:
            allocated -= live.pop(e.addr, e.size)
        elif a in (SEGMENT_ALLOC, SEGMENT_MAP):
            reserved += e.size
        elif a in (SEGMENT_FREE, SEGMENT_UNMAP):
            reserved -= e.size
        if e.time_us is None:
            continue
        over = reserved - allocated
        if over >= min_bytes:
            if start is None:
                start, low, first = e.time_us, over, i
            low = min(low, over)
            if best is None or e.time_us - start > best[1] - best[0]:
                best = (start, e.time_us, low, first, i)
        else:
            start = None
    return best


class ReservedOverhang(SnapshotRule):
    """
    What it detects:
        In a CUDA memory snapshot with history: memory the caching allocator kept reserved while the
        program's live tensors used much less of it, for a long stretch of the recording (reserved
        minus allocated above a threshold the whole time).

    Why it costs:
        Reserved memory belongs to this process: other processes on the device (a second job, an
        evaluation server, a data-loading worker using CUDA) cannot have it, and nvidia-smi shows it as
        used. Within one training loop it is the cache serving the next step, which is right; across
        phases (training, then evaluation or checkpointing) it is memory held for nothing.

    Example:
        bad:   a 4 GiB activation buffer freed after training; the cache keeps 4 GiB through a minute of eval
        good:  torch.cuda.empty_cache() once between the phases (never per step: each call synchronises
               the device and the next step cudaMallocs everything again)

    Fix:
        When the stretch runs to the end of the recording (a phase that no longer needs the memory),
        `torch.cuda.empty_cache()` once between the phases; when it lies between steps, leave the
        cache alone (it is what keeps cudaMalloc out of the steps) and, if another process needs the
        memory, `expandable_segments:True`, whose simulated reserve on the same requests is quoted.

    Evidence needed:
        A CUDA memory snapshot with history with timestamps (torch >= 2.1).
    """

    id = "reserved-overhang"
    title = "GPU memory reserved but unused for a long stretch"
    severity = "info"
    category = "memory"
    options = (Option("min-gib", 1.0, "flag when reserved minus allocated stays at least this many GiB"),
               Option("min-seconds", 10.0, "... for at least this many seconds"),
               Option("min-share", 0.5, "... or for at least this share of the recording's time", high=1))

    def check_device(self, snap: Snapshot, device: int, options: Options) -> Iterable[Finding]:
        h = snap.histories.get(device)
        if h is None or h.first_time_us is None or h.last_time_us is None:
            return
        got = overhang_stretch(snap, device, int(options.min_gib * GiB))
        if got is None:
            return
        start, end, low, first, last = got
        span = max(h.last_time_us - h.first_time_us, 1)
        secs, share = (end - start) / 1e6, (end - start) / span
        if secs < options.min_seconds and share < options.min_share:
            return
        to_end = end == h.last_time_us
        existing = snap.allocator_settings.alloc_conf if snap.allocator_settings else ""
        message = (f"On cuda:{device} at least {format_bytes(low)} stayed reserved by the caching allocator but "
                   f"unallocated for {secs:.1f} s ({share:.0%} of the recording, trace entries {first}-{last}): "
                   f"memory other processes on the device cannot use.")
        if to_end:
            fix = Fix(summary=("The stretch runs to the end of the recording, after the memory was last needed: call "
                               "torch.cuda.empty_cache() once where that phase ends (after training, before "
                               "evaluation or checkpointing), never inside the step loop: each call synchronises "
                               "the device and the next step cudaMallocs everything again."))
        else:
            w = simulate_conf(snap, device, "expandable_segments:True") if not snap.expandable else None
            rec = recorded_figures(snap, device)
            if w is not None and w.reserved_peak_bytes < rec.reserved_peak_bytes:
                value = merge_conf(existing, expandable_segments="True")
                fix = Fix(summary=(f"This is the cache serving the next steps: do not empty it per step. If another process "
                                   f"needs the memory, set {ALLOC_CONF}={value} (simulated on the same requests: reserved "
                                   f"peak {rec.reserved_peak_bytes / GiB:.1f} -> {w.reserved_peak_bytes / GiB:.1f} GiB)."),
                          config={ALLOC_CONF: value})
            else:
                fix = Fix(summary=("This is the cache serving the next steps: leave it; do not call empty_cache per step "
                                   "(each call synchronises the device and the next step cudaMallocs again)."))
        lead = ("GPU memory stays reserved after its last use: free it once then. " if to_end else
                "GPU memory stays reserved between uses: do not free it per step. ")
        yield self.finding(lead + message, fix=fix, evidence={
            "snapshot": snap.path, "device": device, "overhang_bytes": low, "seconds": round(secs, 3),
            "share": round(share, 4), "first_index": first, "last_index": last, "to_end": to_end})
