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
    cat, parent, names = trace.col("cat"), trace.col("parent"), trace.col("name")
    cpu_op = CAT["cpu_op"]
    # the answer depends only on the enclosing chain: memoised per parent, as issuing_op is
    cache: dict[int, int] = trace.__dict__.setdefault("_blocking_op_calls", {})
    out = np.empty(len(rows), dtype=np.int64)
    for i, row in enumerate(np.asarray(rows, dtype=np.int64)):
        key = int(parent[row])
        found = cache.get(key)
        if found is None:
            ops = [r for r in trace.ancestors(int(row))
                   if cat[r] == cpu_op and not _NOT_AN_OP.match(trace.symbols[int(names[r])])]
            scoped = [r for r in ops if "::" in trace.symbols[int(names[r])]]
            found = cache[key] = scoped[-1] if scoped else (ops[-1] if ops else -1)
        out[i] = found if found >= 0 else row
    return out


DATALOADER_NEXT = re.compile(r"^enumerate\(DataLoader\)#.*__next__$")
_NOT_AN_OP = re.compile(r"^(ProfilerStep#\d+|enumerate\(DataLoader\)#.*|## .* ##|Optimizer\..*|"
                        r"autograd::engine::evaluate_function: .*)$")


def issuing_op(trace: Trace, row: int) -> str | None:
    """The operator the user called that led to `row`: the outermost `ns::op` around it
    (`aten::item` rather than the `aten::_local_scalar_dense` it runs)."""
    cat = trace.col("cat")
    link = trace.col("link")
    if cat[row] in GPU_SIDE and link[row] >= 0:
        row = int(link[row])
    key = int(trace.col("parent")[row])  # the answer depends only on the enclosing chain
    cache: dict[int, str | None] = trace.__dict__.setdefault("_issuing_ops", {})
    if key in cache:
        return cache[key]
    chain = [n for n in trace.op_chain(row) if not _NOT_AN_OP.match(n)]
    ops = [n for n in chain if "::" in n]
    found = ops[-1] if ops else (chain[-1] if chain else None)
    cache[key] = found
    return found


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
