"""The rehearsed cs336 transformer step (tests/data/cs336_transformer.py run by `audit run`) set
against the shared recorded step (`transformer_fullstep_with_history`): what
tests/evidence/allocator/test_forecast_vs_recording.py asserts and bench/bench_forecast_vs_recording.py
prints.

Both are snapshots; every allocation is put in a phase by its Python frames: "before" the trace
(alive when the history was switched on: parameters, RoPE buffers, the batch), "forward" (a frame in
the model's forward, its attention or the loss), "step" (a frame in the optimizer's step), else
"backward" (autograd's, made in C++: the recording has no Python frame there, the rehearsal names
the `loss.backward()` line). Per layer = L2 - L1 of two rehearsals of the same shape; the whole model
of L layers = L1 + (L - 1) * per layer.
"""
from __future__ import annotations

from collections import Counter

from auditor.evidence.snapshot import ALLOC, FREE_COMPLETED, Snapshot

RECORDED_LAYERS = 32
# The recorded run's shape (kkaitlyn111/cs336-a2-systems benchmark.py, "2.7b", context 128, fp32)
SHAPE = {"d_model": 2560, "d_ff": 10240, "heads": 32, "layers": 32, "vocab": 10000, "batch": 4, "context": 128}
_FORWARD = {"forward", "cross_entropy_loss", "softmax", "scaled_dot_product_attention"}


def phase_of(frames) -> str:
    names = {f.name for f in frames}
    if "step" in names:
        return "step"
    return "forward" if names & _FORWARD else "backward"


def phases(snap: Snapshot, live_only: bool) -> dict[str, Counter]:
    """Requested sizes by phase: of the allocations live when the trace ends (`live_only`), or of
    every request the trace made (plus those alive before it)."""
    out = {p: Counter() for p in ("before", "forward", "backward", "step")}
    opened: dict[int, object] = {}
    for e in snap.device_traces[0]:
        if e.action == ALLOC:
            opened[e.addr] = e
            if not live_only:
                out[phase_of(e.frames)][e.size] += 1
        elif e.action == FREE_COMPLETED:
            opened.pop(e.addr, None)
    if live_only:
        for e in opened.values():
            out[phase_of(e.frames)][e.size] += 1
    for s in snap.segments:
        for b in s.blocks:
            if b.live and b.address not in opened:
                out["before"][b.requested_size] += 1
    return out


def whole_model(one: Counter, two: Counter, layers: int) -> Counter:
    """The multiset of a model of `layers` layers from those of 1 and 2 layers (exact when every
    layer makes the same requests); raises if the layer's share is not a multiset."""
    per_layer = Counter(two)
    per_layer.subtract(one)
    if any(v < 0 for v in per_layer.values()):
        raise ValueError(f"the 2-layer run makes fewer requests of some size than the 1-layer run: {per_layer}")
    out = Counter(one)
    for k, v in per_layer.items():
        out[k] += (layers - 1) * v
    return +out


def difference(recorded: Counter, forecast: Counter) -> tuple[dict[int, int], dict[int, int]]:
    """(sizes the recording has beyond the forecast, sizes the forecast has beyond the recording)."""
    return dict(sorted((recorded - forecast).items())), dict(sorted((forecast - recorded).items()))


def extrapolate(one: int, two: int, layers: int) -> int:
    """peak(L) = peak(1) + (L - 1) * (peak(2) - peak(1))."""
    return one + (layers - 1) * (two - one)
