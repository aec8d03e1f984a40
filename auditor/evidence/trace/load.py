"""Load a PyTorch profiler (Kineto) Chrome trace into a Trace (auditor.evidence.trace.model), the
columnar evidence the trace rules query (streaming and decoding: auditor.evidence.trace.decode; in
worker processes: auditor.evidence.trace.parallel; steps: auditor.evidence.trace.steps).

Why this shape: traces run to gigabytes, and loading them as a list of Python dicts is what makes
other analysers run out of memory. So the file is streamed: the `traceEvents` array is cut into
chunks on top-level object boundaries, each chunk is decoded by msgspec into typed Structs that
name only the fields the rules read (every other key, and most of `args`, is skipped in C), and the
chunk is turned at once into numpy columns. Names are interned as ints in a symbol table, like
HolisticTraceAnalysis does. Derived columns (end time, one category vocabulary across the old and
new Kineto schemas, runtime<->GPU correlation links, the enclosing CPU event of every CPU event, the
ProfilerStep each event falls in) are computed once here, never in rules.

Both schemas are read: the new one (categories `cpu_op`, `cuda_runtime`, `kernel`, `gpu_memcpy`,
flows `ac2g`, int tids) and the old one (`Operator`, `Runtime`, `Kernel`, `Memcpy`, flows `async`,
tids like "stream 7", lower-case `external id`, a `Call stack` argument instead of Python events).
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from auditor.evidence.errors import InputError
from auditor.evidence.trace import parallel
from auditor.evidence.trace.arg_records import records
from auditor.evidence.trace.columns import Columns
from auditor.evidence.trace.decode import DEFAULT_CHUNK_BYTES, GPU_SIDE, LAUNCH_SIDE, SymbolTable, _decode_args, _Stream
from auditor.evidence.trace.model import Trace
from auditor.evidence.trace.nesting import nest
from auditor.evidence.trace.steps import assign_steps, find_steps

if TYPE_CHECKING:  # (pandas is imported where a trace is read: an audit without one never pays for it)
    import pandas as pd


# ---------------------------------------------------------------------------------------------
def _frames(cols: Columns) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The events and flows frames from the accumulated columns (each concatenated once)."""
    import pandas as pd
    def build(parts: dict[str, list[np.ndarray]]) -> pd.DataFrame:
        columns = {}
        for k in list(parts):
            chunks = parts.pop(k)
            columns[k] = np.concatenate(chunks) if len(chunks) > 1 else chunks[0]
        return pd.DataFrame(columns, copy=False)

    events = build(cols.parts) if cols.parts else _empty_events()
    flows = build(cols.flow_parts) if cols.flow_parts else pd.DataFrame(
        {"id": np.empty(0, np.int64), "start": np.empty(0, bool), "pid": np.empty(0, np.int64),
         "tid": np.empty(0, np.int64), "ts": np.empty(0, np.float64), "cat": np.empty(0, np.int32)})
    return events, flows


_EVENT_DTYPES = {"cat": np.int8, "raw_cat": np.int32, "name": np.int32, "instant": bool, "pid": np.int64,
                 "tid": np.int64, "ts": np.float64, "dur": np.float64, "external_id": np.int64,
                 "correlation": np.int64, "bytes": np.int64, "stream": np.int64, "device": np.int64,
                 "total_allocated": np.int64,
                 "device_type": np.int64, "stack": np.int32, "sync_kind": np.int32, "args": np.int32}


def _empty_events() -> pd.DataFrame:
    import pandas as pd
    return pd.DataFrame({k: np.empty(0, dtype=v) for k, v in _EVENT_DTYPES.items()})


# ---------------------------------------------------------------------------------------------
def _links(cat: np.ndarray, corr: np.ndarray, ts: np.ndarray) -> np.ndarray:
    """Runtime/driver call <-> the GPU work it launched, through the CUPTI correlation id (the
    events' category, correlation and start columns).

    For a GPU-side row: the row of the launching call. For a launching call: its first GPU row.
    """
    link = np.full(len(cat), -1, dtype=np.int64)
    launch = np.flatnonzero(np.isin(cat, LAUNCH_SIDE) & (corr >= 0))
    gpu = np.flatnonzero(np.isin(cat, GPU_SIDE) & (corr >= 0))
    if not len(launch) or not len(gpu):
        return link
    lorder = launch[np.argsort(corr[launch], kind="stable")]
    lcorr = corr[lorder]
    pos = np.searchsorted(lcorr, corr[gpu])
    pos_c = np.minimum(pos, len(lcorr) - 1)
    hit = lcorr[pos_c] == corr[gpu]
    link[gpu[hit]] = lorder[pos_c[hit]]
    # first GPU row of each launch (earliest start)
    g = gpu[hit]
    owner = lorder[pos_c[hit]]
    if len(g):
        by_start = np.lexsort((ts[g], owner))
        owner_sorted = owner[by_start]
        first = np.ones(len(owner_sorted), dtype=bool)
        first[1:] = owner_sorted[1:] != owner_sorted[:-1]
        link[owner_sorted[first]] = g[by_start][first]
    return link



def _release_freed_memory() -> None:
    """Hand freed heap memory back to the OS (glibc only; elsewhere a no-op). The per-chunk column
    arrays are small enough to live on the malloc heap, which keeps their pages after they are
    concatenated and freed: on a 5 GB trace that is ~1.7 GB of RSS held through the analysis."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None


def _finish(path: Path, stream: _Stream, cols: Columns, symbols: SymbolTable) -> Trace:
    events, flows = _frames(cols)
    if not len(events) and stream.dropped:  # every event was of the wrong shape: nothing to judge
        raise InputError(f"{path}: not a usable profiler trace: {_dropped_text(stream)}, and no other timed "
                         f"events are left")
    if not len(events):  # `[]`, or only metadata: a report of it would read "no findings"
        raise InputError(f"{path}: not a profiler trace: it holds no timed events")
    _release_freed_memory()
    events["end"] = events["ts"] + events["dur"]
    # Launches are linked to their GPU work in a thread while this one makes the call tree (numpy
    # lets go of the interpreter in both: on the 506 MB tiling 0.02 s beside 0.15 s). (The tree is
    # made here: what a thread allocates and frees stays in its own malloc arena, resident.)
    with ThreadPoolExecutor(max_workers=1) as pool:
        link = pool.submit(_links, *(events[k].to_numpy() for k in ("cat", "correlation", "ts")))
        events["parent"] = nest(*(events[k].to_numpy() for k in ("cat", "instant", "pid", "tid", "ts", "dur")))
        events["link"] = link.result()
    processes = _processes(cols)
    arg_records = records(cols.args)
    trace_meta = {**stream.header, **stream.trailer}
    old = bool(len(events)) and any(symbols.id(c) >= 0 for c in ("Operator", "Runtime", "Kernel"))
    trace = Trace(path=path, metadata=trace_meta, events=events, flows=flows, symbols=symbols,
                  processes=processes, schema="old" if old else "new", arg_records=arg_records)
    trace.dropped = _dropped_text(stream) if stream.dropped else ""
    trace.steps, trace.steps_from = find_steps(trace)
    events["step"] = assign_steps(trace)
    return trace


def _processes(cols: Columns) -> dict[int, dict[str, Any]]:
    """Per pid, what the metadata events name: the process, its labels, its threads."""
    processes: dict[int, dict[str, Any]] = {}
    for e, args in zip(cols.meta, _decode_args([e.args for e in cols.meta])):
        pid = cols._norm_id(e.pid)
        rec = processes.setdefault(pid, {})
        if e.name == "process_name":
            rec["name"] = args.meta_name
        elif e.name == "process_labels":
            rec["labels"] = args.labels
        elif e.name == "thread_name":
            rec.setdefault("threads", {})[cols._norm_id(e.tid)] = args.meta_name
    return processes


def _dropped_text(stream: _Stream) -> str:
    n = stream.dropped
    return (f"{n:,} event{'s' if n != 1 else ''} with fields of the wrong type or impossible values "
            f"{'were' if n != 1 else 'was'} left out (the first: {stream.dropped_why})")


def load_trace(path: Path | str, chunk_bytes: int = DEFAULT_CHUNK_BYTES, workers: int | None = None) -> Trace:
    """Parse a Kineto/Chrome trace (`.json` or `.json.gz`) with bounded memory.

    A large file is decoded by `workers` processes (default: parallel.worker_count, one per
    core for files of 48 MB and more); 0 or 1 parses in this process. Either way gives the same
    Trace. Raises InputError, with one line naming the file, for missing, truncated, malformed or
    non-trace inputs.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such trace file")
    if workers is None:
        workers = parallel.worker_count(path)
    # No cyclic garbage collection while parsing: millions of short-lived lists and arrays would
    # trigger full collections that walk every object of the process (plotly, pandas...) again and
    # again, for cycles the parser never makes.
    collecting = gc.isenabled()
    gc.disable()
    try:
        with _small_pages():
            if workers > 1:
                try:
                    return _parse(path, chunk_bytes, workers)
                except Exception:  # a worker failed: the one-process parse gives the exact error, or succeeds
                    pass
            return _parse(path, chunk_bytes, 0)
    finally:
        if collecting:
            gc.enable()


@contextmanager
def _small_pages() -> Iterator[None]:
    """numpy's large arrays made inside without its transparent-huge-page hint (madvise), and the
    hint as it was after (the workers, forked inside, inherit it).

    Why: where the kernel's THP defrag setting is `madvise` (the default of Debian's and Ubuntu's
    kernels), the first touch of a hinted array waits while the kernel compacts memory into 2 MB
    pages. The parse makes each of its columns once and touches it once, so it pays the wait and
    keeps none of the gain: on the 506 MB tiled trace the call tree took 0.43 s with the hint and
    0.21 s without, the whole load 1.9-2.0 s against 1.65-1.75 s (bench/HISTORY.md)."""
    try:
        from numpy._core.multiarray import _set_madvise_hugepage
    except ImportError:
        try:  # numpy < 2
            from numpy.core.multiarray import _set_madvise_hugepage
        except ImportError:  # (numpy's private switch gone: the parse runs with numpy's default)
            yield
            return
    was = _set_madvise_hugepage(False)
    try:
        yield
    finally:
        _set_madvise_hugepage(was)


def _parse(path: Path, chunk_bytes: int, workers: int) -> Trace:
    symbols = SymbolTable()
    cols = Columns(symbols)
    stream = _Stream(path, chunk_bytes)
    try:
        stream.start()
        if workers > 1:
            parallel.parse(stream, cols, workers)
        else:
            for events in stream.chunks(timed=False):
                cols.add(events, stream._timed)
        trace = _finish(path, stream, cols, symbols)
        trace.workers = workers if workers > 1 else 0
        return trace
    except (msgspec.DecodeError, RecursionError) as e:  # (what the stream's own checks left: invalid
        # UTF-8 in an argument decoded late, a header nested past the decoder's depth)
        why = "nests objects or arrays too deeply" if isinstance(e, RecursionError) else str(e)
        raise InputError(f"{path}: not a readable profiler trace ({why})") from None
    finally:
        stream.reader.close()
