"""The host->device copies a pin_memory fix makes `non_blocking=True`.

Pinning a DataLoader's batches pays off only when the step's copies of them do not wait: a copy
from pinned memory with non_blocking=True is queued behind the GPU's work and returns at once.
Both rules that pin (pageable-copy, dataloader-bound) say so, and their patches edit the copy calls
a CUDA rehearsal recorded (`h2d-copy` tallies: the user's line, the DataLoader the tensor came
from). The copy still runs in stream order, before any kernel that reads its result, so what the
step computes is unchanged.
"""
from __future__ import annotations

from typing import Iterable

from auditor.evidence import model as m
from auditor.findings import Edit
from auditor.fixes import edit_calls_on_line

# The recorded copy -> the method on the user's line, and how many positional arguments leave no
# room for non_blocking among them: to(other, non_blocking) / to(device, dtype, non_blocking),
# cuda(device, non_blocking), copy_(src, non_blocking).
COPY_CALLS = {"Tensor.to(cuda)": ("to", 2), "Tensor.cuda": ("cuda", 2), "Tensor.copy_(host->cuda)": ("copy_", 2)}


def non_blocking_edits(ev: m.Evidence, loaders: Iterable[int]) -> list[Edit]:
    """Edits adding non_blocking=True to the calls that copied batches of `loaders` (DataLoader ids)
    to the device without it, one per line."""
    ids = set(loaders)
    lines: dict[tuple[str, int], dict[str, int]] = {}
    for _, t in ev.tallies(m.H2D_COPY):
        call = COPY_CALLS.get(t.what)
        if (call and t.where and t.where.file and not t.data.get("non_blocking") and not t.data.get("pinned")
                and t.data.get("loader") in ids):
            lines.setdefault((t.where.file, t.where.line), {})[call[0]] = call[1]
    edits = []
    for (file, line), names in sorted(lines.items()):
        edit = edit_calls_on_line(file, line, names, {"non_blocking": "True"})
        if edit and edit not in edits:
            edits.append(edit)
    return edits
