"""Decode one large trace in worker processes, so that parsing uses every core.

Why: decoding JSON into objects and turning them into columns is CPU-bound Python (msgspec holds
the GIL), and a multi-GB trace takes over a minute on one core. Here the main process reads only
the header and a small window around every PIECE_BYTES of the file, where it cuts the event array
on an event boundary; each worker reads its own byte range and decodes it into numpy columns with
the code the single-process path runs (trace_decode), written into a slot of memory shared with the
main process, which appends the columns in file order, mapping each worker's symbol codes onto its
own table. Everything after (frames,
derived columns) is as in the single-process path, and the Trace is the same.

When it is used: uncompressed files of at least PARALLEL_MIN_BYTES, on Linux, with more than one
usable core and no other thread running in the process (gzip has no random access, and it is the
decompression that bounds those). Workers are forked, so they start in milliseconds with nothing to
import; forking a process that runs other threads is unsafe, hence that condition. Any failure in
a worker (a malformed file, a cut that fell inside a string, a worker killed) makes the caller
parse the file again in one process, which then gives the exact one-line error or the right result:
malformed input is rare, and its error must not depend on where the file was cut.
"""
from __future__ import annotations

import mmap
import multiprocessing
import os
import re
import sys
import threading
import warnings
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from auditor.evidence.errors import InputError
from auditor.evidence.trace.columns import Columns
from auditor.evidence.trace.decode import (_WS, DEFAULT_CHUNK_BYTES, MAX_EVENT_BYTES, SymbolTable, Vocabulary, _Event,
                                           _Stream, too_long)

# Smaller files parse in a few seconds in one process: not worth the workers.
PARALLEL_MIN_BYTES = 48 << 20
# The byte range a worker decodes at a time (in DEFAULT_CHUNK_BYTES chunks): large enough that its
# result's pickling costs little, small enough to keep every worker busy to the end.
PIECE_BYTES = 16 << 20
MAX_WORKERS = 8
TAIL_PIECES = 4  # the file's last this many pieces' worth is cut in half pieces (cuts)
# A piece's columns come back through a slot of memory shared with the workers, not pickled through
# a pipe (pickling, the pipe and unpickling were ~15 ms of each ~65 ms piece). A piece's columns are
# about half its bytes on recorded traces; those that do not fit a slot come back pickled.
SLOT_BYTES = 2 * PIECE_BYTES
SYMBOL_COLUMNS = ("name", "raw_cat", "stack", "sync_kind")
# Where a piece may start: the `{` of an event that follows another one.
_CUT = re.compile(rb"\}\s*,\s*\{")
_WINDOW = 1 << 20


def forkable_cores() -> int:
    """The cores this process may use through forked processes: 0 where it may not fork (not Linux,
    or other Python threads running: forking a process that runs threads is unsafe)."""
    if sys.platform != "linux" or threading.active_count() > 1:
        return 0
    try:
        return len(os.sched_getaffinity(0))
    except (OSError, AttributeError):
        return 0


def worker_count(path: Path) -> int:
    """How many workers to parse `path` with; 0: parse in this process."""
    cores = forkable_cores()
    if cores < 2:
        return 0
    try:
        with open(path, "rb") as f:
            if f.read(2) == b"\x1f\x8b":
                return 0
        if path.stat().st_size < PARALLEL_MIN_BYTES:
            return 0
    except OSError:
        return 0
    return min(cores, MAX_WORKERS)


def cuts(path: Path, start: int) -> list[int]:
    """Offsets where pieces start: `start` (the first event), then the first event boundary at or
    after every further PIECE_BYTES, every PIECE_BYTES / 2 in the file's last TAIL_PIECES pieces'
    worth (so the workers end within half a piece of each other: a worker idle while the other
    decodes a last whole piece cost ~0.05 s of the 506 MB tiling's parse). Only a window of the
    file around each is read."""
    size = path.stat().st_size
    out = [start]
    with open(path, "rb") as f:
        first = os.pread(f.fileno(), 4096, start).lstrip(_WS)
        if first[:1] not in (b"{", b"]", b""):  # (the first event is read first: no scan of the rest)
            raise InputError(f"{path}: not a profiler trace: traceEvents holds a non-object")
        target = start + PIECE_BYTES
        while target < size - PIECE_BYTES // 4:  # (no sliver of a last piece)
            m = _CUT.search(os.pread(f.fileno(), _WINDOW, target))
            if m is None:  # an event larger than the window: cut further on
                target += _WINDOW
                if target - out[-1] > PIECE_BYTES + MAX_EVENT_BYTES:
                    raise InputError(f"{path}: {too_long(out[-1])}")
                continue
            out.append(target + m.end() - 1)
            target = out[-1] + (PIECE_BYTES if size - out[-1] > TAIL_PIECES * PIECE_BYTES else PIECE_BYTES // 2)
    return out


def parse(stream: _Stream, cols: Columns, workers: int) -> None:
    """Fill `cols` with every event after stream.start() (and stream.trailer with what follows the
    array), decoded by `workers` processes. At most two pieces per worker are in flight, so memory
    stays bounded whatever the file's size. Raises whatever a worker raised."""
    if stream.reader is None or stream.reader.stream is not stream.reader.raw:
        raise ValueError(f"{stream.path}: compressed, so it cannot be cut by offset")
    starts = cuts(stream.path, stream.base + stream.pos)
    ends = [*starts[1:], None]
    luts: dict[int, list[int]] = {}  # worker pid -> the main table's code of each of its symbols
    arg_luts: dict[int, list[int]] = {}  # ... and of each of its argument records
    pending: deque[tuple[Future, int]] = deque()
    total = (stream.path.stat().st_size - starts[0]) or 1
    events, flows = _Filling(total), _Filling(total)
    context = multiprocessing.get_context("fork")
    global _slots
    _slots = shared = _Slots(2 * workers, SLOT_BYTES)  # (made before the workers are forked: they inherit it)
    with shared, warnings.catch_warnings(), ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        # Python 3.12+ warns at every fork of a process with more than one OS thread. The only other
        # threads here are native pools (OpenBLAS's, idle) that the workers never call into; Python
        # threads rule the workers out altogether (worker_count).
        warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks",
                                category=DeprecationWarning)
        def merge_first() -> None:
            future, slot = pending.popleft()
            _merge(future.result(), shared, cols, luts, arg_luts, stream, events, flows)
            shared.free.append(slot)

        try:
            for i, (a, b) in enumerate(zip(starts, ends)):
                slot = shared.free.pop()
                pending.append((pool.submit(_decode_range, stream.path, a, b, slot), slot))
                if i == 2 * workers - 1:
                    # the frames are made with pandas once the pieces are in: imported here, while the
                    # workers decode the first pieces (an audit without a trace never imports it)
                    import pandas  # noqa: F401
                if len(pending) >= 2 * workers:
                    merge_first()
            while pending:
                merge_first()
        except BaseException:
            for f, _ in pending:
                f.cancel()
            raise
        finally:
            _slots = None
    cols.parts.update(events.columns())
    cols.flow_parts.update(flows.columns())


class _Filling:
    """Columns filled piece by piece, in file order, into arrays allocated once for the whole file
    (their length estimated from the rows per byte of the pieces so far, grown by half when short).

    Why: the main process is idle while the workers decode, so the pieces are copied into place
    then, as they come, and each piece's memory is reused by the next; concatenating them all at
    the end would touch twice the memory, on the one core, after the decode."""

    def __init__(self, total_bytes: int) -> None:
        self.total_bytes = total_bytes
        self.arrays: dict[str, np.ndarray] = {}
        self.rows = 0
        self.bytes = 0  # of the pieces added

    def add(self, parts: dict[str, np.ndarray], n_bytes: int, luts: dict[str, np.ndarray]) -> None:
        """Append a piece's columns (all of one length; `luts`: a code table to map a column
        through on the way)."""
        self.bytes += n_bytes
        if not parts:
            return
        k = len(next(iter(parts.values())))
        if self.arrays and (parts.keys() != self.arrays.keys()
                            or any(a.dtype != self.arrays[key].dtype for key, a in parts.items())):
            raise ValueError("a piece has other columns than the pieces before it")  # (one process parses it)
        if any(len(a) != k for a in parts.values()):
            raise ValueError("a piece has columns of different lengths")
        capacity = len(next(iter(self.arrays.values()))) if self.arrays else 0
        if self.rows + k > capacity:
            need = self.rows + k
            expect = int(need / max(self.bytes, 1) * self.total_bytes * 1.05) + 1024
            self._resize(max(expect, need + need // 2), parts)
        at = slice(self.rows, self.rows + k)
        for key, arr in parts.items():
            lut = luts.get(key)
            if lut is None:
                self.arrays[key][at] = arr
            else:
                np.take(lut, arr, out=self.arrays[key][at])
        self.rows += k

    def _resize(self, capacity: int, parts: dict[str, np.ndarray]) -> None:
        for key, arr in parts.items():
            new = np.empty(capacity, dtype=arr.dtype)
            old = self.arrays.get(key)
            if old is not None:
                new[:self.rows] = old[:self.rows]
            self.arrays[key] = new

    def columns(self) -> dict[str, list[np.ndarray]]:
        """The filled columns, as the one chunk of each (cols.parts' form)."""
        return {key: [arr[:self.rows]] for key, arr in self.arrays.items()}


class _Slots:
    """`count` slots of `size` bytes of memory shared with the workers forked after it is made: a
    worker writes a piece's columns into the slot the piece was given, the main process reads them
    from there, and the slot is given to another piece once they are copied into place."""

    ALIGN = 64

    def __init__(self, count: int, size: int) -> None:
        self.size = size
        self.memory = mmap.mmap(-1, count * size)  # anonymous and shared: pages are touched as used
        self.free = list(range(count))

    def put(self, slot: int, columns: list[dict[str, list[np.ndarray]]]) -> list[list[tuple]] | None:
        """Write each set of columns (each column in chunks) into `slot`; their layout, or None when
        they do not fit, or are not plain numbers of one dtype (those are pickled)."""
        if any(a.dtype != chunks[0].dtype or a.dtype.hasobject
               for cols in columns for chunks in cols.values() for a in chunks):
            return None
        need = sum(-(-sum(a.nbytes for a in chunks) // self.ALIGN) * self.ALIGN
                   for cols in columns for chunks in cols.values())
        if need > self.size:
            return None
        at = slot * self.size
        layouts = []
        for cols in columns:
            layout = []
            for key, chunks in cols.items():
                rows = sum(len(a) for a in chunks)
                dtype = chunks[0].dtype
                np.concatenate(chunks, out=np.frombuffer(self.memory, dtype, rows, at))
                layout.append((key, dtype.str, at, rows))
                at += -(-rows * dtype.itemsize // self.ALIGN) * self.ALIGN
            layouts.append(layout)
        return layouts

    def get(self, layout: list[tuple]) -> dict[str, np.ndarray]:
        """Views of the columns `put` wrote (valid until the slot is given to another piece)."""
        return {key: np.frombuffer(self.memory, np.dtype(dtype), rows, at) for key, dtype, at, rows in layout}

    def __enter__(self) -> _Slots:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.memory.close()
        except BufferError:  # a view is still held (an exception's traceback): freed with it
            pass


def _merge(res: dict[str, Any], shared: _Slots, cols: Columns, luts: dict[int, list[int]],
           arg_luts: dict[int, list[int]], stream: _Stream, events: _Filling, flows: _Filling) -> None:
    """Append one piece's columns, its symbol and argument record codes mapped onto the main tables."""
    if res["trailer"] is not None:
        stream.trailer = res["trailer"]
    if res["dropped"]:
        stream.dropped_why = stream.dropped_why or res["dropped_why"]
        stream.dropped += res["dropped"]
    codes = luts.setdefault(res["pid"], [])
    if res["names"]:
        codes.extend(cols.symbols.intern_many(res["names"]).tolist())
    lut = np.asarray([*codes, -1], dtype=np.int32)  # -1 ("none") stays -1
    arg_codes = arg_luts.setdefault(res["pid"], [])
    if res["arg_keys"]:
        arg_codes.extend(cols.args.intern_many(res["arg_keys"]).tolist())
    arg_lut = np.asarray([*arg_codes, -1], dtype=np.int32)
    if res["layout"] is not None:
        parts, flow_parts = (shared.get(layout) for layout in res["layout"])
    else:
        parts, flow_parts = res["parts"], res["flows"]
    events.add(parts, res["bytes"], {**dict.fromkeys(SYMBOL_COLUMNS, lut), "args": arg_lut})
    flows.add(flow_parts, res["bytes"], {"cat": lut})
    cols.meta.extend(_Event(ph=ph, name=name, pid=pid, tid=tid, args=msgspec.Raw(args))
                     for ph, name, pid, tid, args in res["meta"])


# -------------------------------------------------------------------------------------------------
# In the worker

_worker_cols: Columns | None = None
_worker_vocabulary: Vocabulary | None = None  # (learnt over all of a worker's pieces)
_slots: _Slots | None = None  # (set in the main process while its workers run: they inherit it)


def _piece(path: Path, start: int, end: int | None) -> tuple[_Stream, int]:
    """The stream of the events in bytes [start, end) of the file (to its end, with the trailer
    after the array, when `end` is None), and their byte count. The bytes are read through a private
    mapping of the file, not copied into a buffer: only the pages the stream writes its brackets
    into are copied (the byte before the piece, the one after its last event). Allocating, zeroing
    and filling a 16 MB buffer was ~5 ms of each ~65 ms piece."""
    with open(path, "rb") as f:
        stop = os.fstat(f.fileno()).st_size if end is None else end
        base = (start - 1) // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
        try:
            text = mmap.mmap(f.fileno(), stop - base, flags=mmap.MAP_PRIVATE,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=base)
        except ValueError:  # (shorter than the offsets cut from it)
            raise InputError(f"{path}: changed while it was read") from None
    first, stop = start - base, stop - base
    stream = _Stream(path, DEFAULT_CHUNK_BYTES, data=text)  # type: ignore[arg-type]
    if end is None:  # the last piece: inside the array, to its `]` and the trailer after it
        stream.pos = first
        return stream, stop - first
    # whole events and the comma after the last: a bare array of its own
    k = text.rfind(b"}", first, stop)
    if k < 0 or text[k + 1:stop].strip(_WS + b",") or text[k + 1:stop].count(b",") != 1:
        raise InputError(f"{path}: a piece does not end after an event")
    text[first - 1] = 0x5B
    text[k + 1] = 0x5D
    text[k + 2:stop] = b" " * (stop - k - 2)
    stream.pos = first - 1
    stream.start()
    return stream, stop - first


def _decode_range(path: Path, start: int, end: int | None, slot: int) -> dict[str, Any]:
    """Columns of the events in bytes [start, end) of the file (to its end, with the trailer after
    the array, when `end` is None), written into shared `slot` (`layout`) or, where they do not
    fit, returned (`parts`, `flows`). Symbol codes are this worker's; `names` are the symbols it
    learnt since its previous piece (the main process keeps the others)."""
    global _worker_cols, _worker_vocabulary
    if _worker_cols is None or _worker_vocabulary is None:
        _worker_cols, _worker_vocabulary = Columns(SymbolTable()), Vocabulary()
    cols = _worker_cols
    known, known_args = len(cols.symbols), len(cols.args)
    stream, n = _piece(path, start, end)
    stream.vocabulary = _worker_vocabulary
    for events in stream.chunks(timed=False):
        cols.add(events, stream._timed)
    assert _slots is not None
    layout = _slots.put(slot, [cols.parts, cols.flow_parts])
    if layout is None:
        parts = {k: np.concatenate(v) for k, v in cols.parts.items()}
        flows = {k: np.concatenate(v) for k, v in cols.flow_parts.items()}
    else:
        parts = flows = None
    meta = [(e.ph, e.name, e.pid, e.tid, bytes(e.args)) for e in cols.meta]
    cols.parts.clear()
    cols.flow_parts.clear()
    cols.meta.clear()
    return {"pid": os.getpid(), "bytes": n, "names": cols.symbols.names[known:], "arg_keys": cols.args.keys[known_args:],
            "layout": layout, "parts": parts, "flows": flows, "meta": meta,
            "trailer": stream.trailer if end is None else None, "dropped": stream.dropped,
            "dropped_why": stream.dropped_why}
