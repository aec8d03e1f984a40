"""Queries the trace rules share on a Trace: the calls during which the host waited for the GPU
(blocking_calls) and the operators that issued them, the GPU's busy intervals (what each idle gap
was waiting on is auditor.evidence.trace.gaps'), the operator a row was issued by, and the user's code behind rows (sites) with the
place a Location shows for a frame."""
from __future__ import annotations

import re
from typing import Any

import numpy as np

from auditor.evidence.frame import Frame
from auditor.evidence.trace.decode import CAT, GPU_SIDE, GPU_WORK
from auditor.evidence.trace.intervals import clip, merge_intervals
from auditor.evidence.trace.call_lines import CandidateFrame
from auditor.evidence.trace.model import StartedFrame, Trace
from auditor.evidence.trace.names import ASYNC_COPY_CALLS, SYNC_CALLS
from auditor.evidence import source_access

PAGEABLE_DTOH = re.compile(r"DtoH.*Pageable")


def blocking_calls(trace: Trace) -> np.ndarray:
    """Rows of the runtime/driver calls during which the host waited for the GPU: the sync calls,
    and the asynchronous copies that are not (device-to-pageable, by the copy they launched).
    Found once per trace (host-sync and gpu-idle both ask). The auditor's own (the numerics
    checks' one read a step, inside `auditor::numerics`) are left out: they are not the program's."""
    cached = trace.__dict__.get("_blocking_calls")
    if cached is not None:
        return cached
    calls = trace.named(SYNC_CALLS, trace.of("runtime", "driver")).index.to_numpy()
    copies = trace.named(ASYNC_COPY_CALLS, trace.of("runtime", "driver")).index.to_numpy()
    if len(copies):
        link = trace.col("link")[copies]
        linked = copies[link >= 0]
        dtoh = set(trace.symbols.matching(PAGEABLE_DTOH))
        names = trace.col("name")[trace.col("link")[linked]]
        copies = linked[np.isin(names, list(dtoh))]
    rows = np.sort(np.concatenate([calls, copies])).astype(np.int64)
    if len(trace.auditor_ranges()):
        rows = rows[~trace.auditor_rows()[rows]]
    trace.__dict__["_blocking_calls"] = rows
    return rows


def blocking_op_calls(trace: Trace, rows: np.ndarray) -> np.ndarray:
    """For each blocking row (of `blocking_calls`), the row of the operator call the user made
    that issued it: the outermost `ns::op` around it, the one `issuing_op` names (`aten::to`,
    `aten::is_nonzero`), or the row itself when no operator encloses it (a bare
    `cudaEventSynchronize`).

    Why: one call can block in several runtime rows. `.cpu()` / `.item()` copy to pageable memory
    (cudaMemcpyAsync, which returns only once the copy is done) and then sync the stream in the
    same `_local_scalar_dense` / `_to_copy`; a driver sync can be recorded inside the runtime sync
    that made it. Counted per row, each such call waits "twice"; rules count the calls (rows
    grouped by this answer) and the union of their rows' time. Interval unions (gpu-idle's
    "host synchronisation", the idle time behind the waits) stay on the rows themselves."""
    out = np.empty(len(rows), dtype=np.int64)
    for i, row in enumerate(np.asarray(rows, dtype=np.int64)):
        found = issuing_row(trace, int(row))
        out[i] = found if found >= 0 else row
    return out


DATALOADER_NEXT = re.compile(r"^enumerate\(DataLoader\)#.*__next__$")
_NOT_AN_OP = re.compile(r"^(ProfilerStep#\d+|enumerate\(DataLoader\)#.*|## .* ##|Optimizer\..*|"
                        r"autograd::engine::evaluate_function: .*)$")


def issuing_op(trace: Trace, row: int) -> str | None:
    """The operator the user called that led to `row`: the outermost `ns::op` around it
    (`aten::item` rather than the `aten::_local_scalar_dense` it runs)."""
    found = issuing_row(trace, row)
    return trace.name(found) if found >= 0 else None


def issuing_row(trace: Trace, row: int) -> int:
    """The row of the operator the user called that led to `row` (for a GPU row: to its launch):
    the outermost `ns::op` enclosing it, else the outermost operator (`_NOT_AN_OP` aside); -1 for
    none. The answer of each enclosing event (for itself and what encloses it) is kept, so every
    event is judged once however deep the chains: a trace whose events all share one `ts` nests
    them all in one chain, and a walk per row was quadratic (290 s for a 31 MB trace)."""
    cat, link, parent, names = trace.col("cat"), trace.col("link"), trace.col("parent"), trace.col("name")
    if cat[row] in GPU_SIDE and link[row] >= 0:
        row = int(link[row])
    # enclosing event -> (its chain's outermost scoped operator, its chain's outermost operator)
    memo: dict[int, tuple[int, int]] = trace.__dict__.setdefault("_issuing_rows", {})
    walk: list[int] = []
    p = int(parent[row])
    while p >= 0 and p not in memo and len(walk) <= len(parent):  # (the bound: no cycle runs forever)
        walk.append(p)
        p = int(parent[p])
    scoped, outer = memo.get(p, (-1, -1))
    cpu_op = CAT["cpu_op"]
    for q in reversed(walk):  # outermost first: the first operator met is the chain's outermost
        if cat[q] == cpu_op and (scoped < 0 or outer < 0):
            name = trace.symbols[int(names[q])]
            if not _NOT_AN_OP.match(name):
                outer = q if outer < 0 else outer
                scoped = q if scoped < 0 and "::" in name else scoped
        memo[q] = (scoped, outer)
    return scoped if scoped >= 0 else outer


def gpu_busy(trace: Trace, lo: float | None = None, hi: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Merged intervals when any GPU stream runs a kernel, copy or memset (clipped to [lo, hi]).
    The union is made once per trace: several rules and findings ask for it."""
    iv = trace.__dict__.get("_gpu_busy")
    if iv is None:
        ev = trace.events
        g = ev[ev["cat"].isin(GPU_WORK)]
        iv = trace.__dict__["_gpu_busy"] = merge_intervals(g["ts"].to_numpy(), g["end"].to_numpy())
    if lo is not None and hi is not None:
        iv = clip(iv, lo, hi)
    return iv



def frame_location_parts(frame: Frame) -> tuple[str, int, str, str]:
    """(file, line, source line, note) for a Location: the source only when the file is on this
    disk, and the note saying what the place stands for when the trace does not name the line that
    did the work (a function's def line, the line a frame was on when the profiler started)."""
    code = source_access.getline(frame.file, frame.line).strip() if frame.file else ""
    note = ""
    if isinstance(frame, CandidateFrame):
        # several lines of the function can make the op: none is named as if it were the one
        return frame.file, frame.line, "", (f"one of lines {', '.join(map(str, frame.lines))}: the trace records "
                                            f"{frame.function or 'this code'}, not which of its lines")
    if isinstance(frame, StartedFrame):
        note = (f"the line {frame.function or 'this code'} was on when the profiler started: the trace does "
                f"not record the line within it")
    elif code.startswith(("def ", "async def ")):
        # torch >= 2 traces name Python functions by their first line: the call is somewhere in it
        note = "the trace records this function, not the line within it"
    return frame.file, frame.line, code, note


def sites(trace: Trace, rows: list[int] | np.ndarray, weights: list[float] | np.ndarray | None = None,
          limit: int = 5) -> list[tuple[Frame, int, float]]:
    """User frames behind rows, grouped: [(frame, count, summed weight)], heaviest first."""
    acc: dict[tuple[Any, ...], list[Any]] = {}
    w = np.ones(len(rows)) if weights is None else np.asarray(weights, dtype=np.float64)
    for r, x in zip(rows, w):
        f = trace.user_frame(int(r))
        if f is None:
            continue
        key = (f.file, f.line, isinstance(f, StartedFrame), getattr(f, "lines", ()))
        slot = acc.setdefault(key, [f, 0, 0.0])
        slot[1] += 1
        slot[2] += float(x)
    out = sorted(((f, n, s) for f, n, s in acc.values()), key=lambda t: (-t[2], -t[1]))
    return out[:limit]
