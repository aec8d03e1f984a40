"""Parse a PyTorch profiler (Kineto) Chrome trace into columnar evidence the trace rules query.

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
import gzip
import math
import operator
import re
import zlib
from collections.abc import Iterator
from itertools import compress, repeat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pandas as pd

from auditor.evidence.errors import InputError
from auditor.evidence.model import Frame  # noqa: F401  (re-exported for rules)
from auditor.evidence.recorded_frames import is_library_file, parse_frame  # noqa: F401

# ---------------------------------------------------------------------------------------------
# The one category vocabulary rules use (the `cat` column holds the index into this tuple).
CATEGORIES: tuple[str, ...] = (
    "other", "cpu_op", "annotation", "python", "runtime", "driver", "kernel", "memcpy", "memset",
    "gpu_annotation", "sync", "memory", "trace", "overhead", "instant",
)
CAT = {name: i for i, name in enumerate(CATEGORIES)}

_RAW_CATEGORY = {
    "cpu_op": "cpu_op", "operator": "cpu_op",
    "user_annotation": "annotation",
    "python_function": "python",
    "cuda_runtime": "runtime", "runtime": "runtime",
    "cuda_driver": "driver",
    "kernel": "kernel",
    "gpu_memcpy": "memcpy", "memcpy": "memcpy",
    "gpu_memset": "memset", "memset": "memset",
    "gpu_user_annotation": "gpu_annotation",
    "cuda_sync": "sync",
    "trace": "trace",
    "overhead": "overhead",
    "cpu_instant_event": "instant",
}
# Categories that run on the host thread and nest into one another.
CPU_NESTING = (CAT["cpu_op"], CAT["annotation"], CAT["python"], CAT["runtime"], CAT["driver"])
# Work the GPU does (device busy time), and the GPU-side records a launch can map to.
GPU_WORK = (CAT["kernel"], CAT["memcpy"], CAT["memset"])
GPU_SIDE = GPU_WORK + (CAT["sync"],)
LAUNCH_SIDE = (CAT["runtime"], CAT["driver"])

FLOW_CATEGORIES = ("ac2g", "async", "fwdbwd")
STEP_NAME = re.compile(r"^ProfilerStep#(\d+)$")

DEFAULT_CHUNK_BYTES = 2 << 20


# ---------------------------------------------------------------------------------------------
# Typed decode: only the fields rules read. msgspec skips every other key without building it.
class _Args(msgspec.Struct, frozen=True, gc=False):
    # -1 for "absent" keeps the columns pure ints, so they convert to numpy without a Python pass;
    # an explicit JSON null still decodes (as None) and takes the slower path.
    external_id: int | None = msgspec.field(default=-1, name="External id")
    external_id_old: int | None = msgspec.field(default=-1, name="external id")
    correlation: int | None = -1
    bytes: int | None = -1
    mem_bytes: int | None = msgspec.field(default=-1, name="Bytes")
    total_allocated: int | None = msgspec.field(default=-1, name="Total Allocated")
    device_type: int | None = msgspec.field(default=-1, name="Device Type")
    stream: int | None = -1
    device: int | None = -1
    call_stack: str | None = msgspec.field(default=None, name="Call stack")
    sync_kind: str | None = msgspec.field(default=None, name="cuda_sync_kind")
    meta_name: Any = msgspec.field(default=None, name="name")  # ph "M": process / thread names
    labels: Any = None


_NO_ARGS = _Args()
_EMPTY_RAW = msgspec.Raw(b"{}")


class _Event(msgspec.Struct, gc=False):
    """One event. `args` stays raw JSON: most events' args (Python frames, operator shapes) are
    never read, so they are skipped at C speed and only the rows whose args a column needs are
    decoded, in one batch per chunk (see _Columns.add)."""

    ph: str = ""
    name: str = ""
    cat: str = ""
    pid: int | str = -1
    tid: int | str = -1
    ts: float = math.nan
    dur: float = 0.0
    id: int | str | None = None
    args: msgspec.Raw = _EMPTY_RAW


class _LooseEvent(msgspec.Struct):
    """Fallback for a chunk whose values do not fit the typed schema (a string where a number was
    expected, a null name): decoded loosely, then coerced field by field in Python."""

    ph: Any = ""
    name: Any = ""
    cat: Any = ""
    pid: Any = -1
    tid: Any = -1
    ts: Any = math.nan
    dur: Any = 0.0
    id: Any = None
    args: Any = None


_DECODER = msgspec.json.Decoder(list[_Event])
# phase -> 1 complete event row (X), 4 other event row (instants, B/E, counters...), 2 flow,
# 3 metadata, 0 ignored
_PHASE_KIND = {"X": 1, "i": 4, "I": 4, "B": 4, "E": 4, "b": 4, "e": 4, "n": 4, "C": 4,
               "s": 2, "f": 2, "t": 2, "M": 3}
_ARGS_DECODER = msgspec.json.Decoder(list[_Args])
_LOOSE_DECODER = msgspec.json.Decoder(list[_LooseEvent])
_ARG_FIELDS = {f.encode_name: f.name for f in msgspec.structs.fields(_Args)}


def _to_int(v: Any) -> int | None:
    if v is None or isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return int(v) if math.isfinite(v) else None
    if isinstance(v, str):
        s = v.strip()
        try:
            return int(s, 0)
        except ValueError:
            try:
                return int(float(s))
            except ValueError:
                return None
    return None


def _to_float(v: Any, default: float) -> float:
    if isinstance(v, bool) or v is None:
        return default
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return default
    return default


def _args_from_dict(d: Any) -> _Args:
    """Typed args from a loosely decoded value, coercing field by field."""
    if not isinstance(d, dict):
        return _NO_ARGS
    kw: dict[str, Any] = {}
    for key, attr in _ARG_FIELDS.items():
        if key in d:
            v = d[key]
            if attr in ("call_stack", "sync_kind"):
                kw[attr] = v if isinstance(v, str) else None
            elif attr in ("meta_name", "labels"):
                kw[attr] = v
            else:
                got = _to_int(v)
                kw[attr] = -1 if got is None else got
    return _Args(**kw)


def _decode_args(raws: list[msgspec.Raw]) -> list[_Args]:
    """Decode many raw args objects in one call; values of unexpected types are coerced."""
    if not raws:
        return []
    blob = b"[" + b",".join(raws) + b"]"
    try:
        return _ARGS_DECODER.decode(blob)
    except msgspec.ValidationError:
        return [_args_from_dict(d) for d in msgspec.json.decode(blob)]


def _coerce(loose: _LooseEvent) -> _Event:
    args = msgspec.Raw(msgspec.json.encode(loose.args)) if isinstance(loose.args, dict) else _EMPTY_RAW
    ident = loose.id if isinstance(loose.id, (int, str)) and not isinstance(loose.id, bool) else None
    return _Event(
        ph=loose.ph if isinstance(loose.ph, str) else "",
        name=loose.name if isinstance(loose.name, str) else ("" if loose.name is None else str(loose.name)),
        cat=loose.cat if isinstance(loose.cat, str) else "",
        pid=loose.pid if isinstance(loose.pid, (int, str)) and not isinstance(loose.pid, bool) else -1,
        tid=loose.tid if isinstance(loose.tid, (int, str)) and not isinstance(loose.tid, bool) else -1,
        ts=_to_float(loose.ts, math.nan), dur=_to_float(loose.dur, 0.0), id=ident, args=args)


# ---------------------------------------------------------------------------------------------
# Streaming the file: blocks of bytes -> header dict, chunks of complete events, trailer dict.
_TRACE_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_BOUNDARY = re.compile(rb"\}\s*(?:,\s*\{|\])")
_WS = b" \t\r\n"
_NON_WS = re.compile(rb"[^ \t\r\n]")


class _Reader:
    """The file's bytes, gunzipped on the fly when it is gzip (detected by magic), read straight
    into the caller's buffer; read errors become one-line InputErrors."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.raw = open(path, "rb")
            magic = self.raw.read(2)
            self.raw.seek(0)
        except OSError as e:
            raise InputError(f"{path}: cannot read ({e.strerror or e})") from None
        self.stream = gzip.GzipFile(fileobj=self.raw) if magic == b"\x1f\x8b" else self.raw

    def readinto(self, target: memoryview) -> int:
        """Fill `target` (fewer bytes only at the end of the file); the count read."""
        got = 0
        if self.raw.closed:
            return 0
        try:
            while got < len(target):
                n = self.stream.readinto(target[got:])
                if not n:
                    break
                got += n
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise InputError(f"{self.path}: not a readable gzip trace ({e or 'compressed file ended early'})") from None
        except OSError as e:
            raise InputError(f"{self.path}: cannot read ({e.strerror or e})") from None
        return got

    def rest(self) -> bytes:
        out = bytearray()
        block = bytearray(1 << 20)
        with memoryview(block) as view:
            while n := self.readinto(view):
                out += view[:n]
        return bytes(out)

    def close(self) -> None:
        if not self.raw.closed:
            self.stream.close()
            self.raw.close()


def _error_offset(err: Exception) -> int | None:
    m = re.search(r"byte (\d+)", str(err))
    return int(m.group(1)) if m else None


class _Stream:
    """Cuts the traceEvents array into decodable chunks without ever holding the whole file.

    The buffer is a bytearray whose first byte is padding, never file data: a chunk of events is
    decoded in place by writing `[` just before it and `]` just after it (see _decode_prefix),
    without copying it. The file is read straight into each new buffer, after the few unread
    bytes carried over from the last one. A buffer is never written again once events were
    decoded from it: their raw `args` point into it."""

    def __init__(self, path: Path, chunk_bytes: int):
        self.path = path
        self.chunk = max(1 << 16, chunk_bytes)
        self.reader = _Reader(path)
        self.buf = bytearray(b" ")
        self.eof = False
        self.header: dict[str, Any] = {}
        self.trailer: dict[str, Any] = {}
        self.pos = 1  # where unread data starts in buf
        self.base = -1  # buf[j] is byte base + j of the (decompressed) stream

    def _more(self) -> bool:
        """Read the next block into a new buffer, after the unread rest of the current one."""
        if self.eof:
            return False
        left = len(self.buf) - self.pos
        buf = bytearray(1 + left + self.chunk)
        buf[1:1 + left] = memoryview(self.buf)[self.pos:]
        with memoryview(buf) as view:
            got = self.reader.readinto(view[1 + left:])
        if not got:
            self.eof = True
            self.reader.close()
            return False
        if got < self.chunk:
            del buf[1 + left + got:]
        self.base += self.pos - 1
        self.buf = buf
        self.pos = 1
        return True

    def _fail(self, what: str) -> InputError:
        return InputError(f"{self.path}: {what}")

    def _next_token(self) -> int:
        """Position of the next non-whitespace byte at or after pos, reading more when needed."""
        while True:
            m = _NON_WS.search(self.buf, self.pos)
            if m:
                return m.start()
            self.pos = len(self.buf)
            if not self._more():
                return -1

    def start(self) -> None:
        """Read up to the opening `[` of traceEvents and decode what came before it."""
        while True:
            p = self._next_token()
            if p < 0:
                raise self._fail("not a profiler trace: the file is empty")
            first = self.buf[p:p + 1]
            if first == b"[":  # Chrome's bare-array form: no metadata at all
                self.pos = p + 1
                self.bare = True
                return
            if first != b"{":
                raise self._fail("not a JSON profiler trace (does not start with '{' or '[')")
            m = _TRACE_EVENTS_KEY.search(self.buf, p)
            if m:
                prefix = self.buf[p:m.start()].rstrip(_WS)
                if prefix.endswith(b","):
                    prefix = prefix[:-1]
                try:
                    self.header = msgspec.json.decode(prefix + b"}") if prefix.strip(_WS) != b"{" else {}
                except msgspec.DecodeError:
                    raise self._fail("not a profiler trace: malformed JSON before traceEvents") from None
                if not isinstance(self.header, dict):
                    raise self._fail("not a profiler trace")
                self.pos = m.end()
                return
            if len(self.buf) > 256 << 20 or not self._more():
                raise self._fail("not a profiler trace: no traceEvents array found")

    def chunks(self) -> Iterator[tuple[list[_Event], bool]]:
        """Decoded lists of events, chunk by chunk, until the closing `]` of the array, each with
        whether its text holds an old-schema `Call stack` argument (then operator args are read).

        The buffer is only ever sliced once per block read; chunks are addressed by offsets."""
        while True:
            while len(self.buf) - self.pos < self.chunk and self._more():
                pass
            p = self._next_token()
            if p < 0:
                raise self._fail("truncated trace: the traceEvents array never closes")
            first = self.buf[p:p + 1]
            if first == b"]":
                self._finish(self.buf[p + 1:])
                return
            if first == b",":  # the separator left before the next chunk
                self.pos = p + 1
                p = self._next_token()
                if p < 0:
                    raise self._fail("truncated trace: the traceEvents array never closes")
            self.pos = p
            events, cut = self._decode_prefix(p)
            if events is None:  # no complete event in the buffer: an event larger than a block
                if not self._more():
                    raise self._fail("truncated trace: the traceEvents array never closes")
                self.chunk = max(self.chunk, len(self.buf))
                continue
            has_stacks = self.buf.find(b'"Call stack"', p, cut) >= 0
            self.pos = cut
            yield events, has_stacks

    def _decode_prefix(self, p: int) -> tuple[list[_Event] | None, int]:
        """Decode the longest run of complete events in the buffer from `p`; return them and the
        offset just past the last one.

        A candidate cut is a `}` followed by `,{` or `]`. A cut inside a string or a nested object
        makes the wrapped chunk fail at its very end, and a cut past the end of the array leaves
        trailing characters, so we step back to an earlier cut; an error earlier in the chunk is
        real malformation.
        """
        buf = self.buf
        end = len(buf)
        tries = 0
        while True:
            i = buf.rfind(b"}", p, end)
            while i >= 0 and not _BOUNDARY.match(buf, i):
                i = buf.rfind(b"}", p, i)
            if i < 0:
                return None, p
            # buf[p - 1] (padding, whitespace, `,` or `[`) and buf[i + 1] (whitespace, `,` or `]`)
            # lie outside every event: they become the brackets of the array decoded in place.
            before, after = buf[p - 1], buf[i + 1]
            buf[p - 1], buf[i + 1] = 0x5B, 0x5D
            piece = memoryview(buf)[p - 1:i + 2]
            try:
                events = _DECODER.decode(piece)
            except msgspec.ValidationError:
                try:
                    events = [_coerce(e) for e in _LOOSE_DECODER.decode(piece)]
                except msgspec.ValidationError as e:
                    raise self._fail(f"not a profiler trace: traceEvents holds a non-object ({e})") from None
                except msgspec.DecodeError:
                    events = None
            except msgspec.DecodeError as e:
                off = _error_offset(e)
                wrong_cut = "truncated" in str(e) or "trailing characters" in str(e)
                if off is not None and off < len(piece) - 2 and not wrong_cut:
                    detail = re.sub(r"\s*\(byte \d+\)", "", str(e))
                    raise self._fail(f"malformed JSON in traceEvents near byte "
                                     f"{self.base + p + off - 1}: {detail}") from None
                events = None
            finally:
                buf[p - 1], buf[i + 1] = before, after
            if events is not None:
                return events, i + 1
            tries += 1
            end = i
            if tries > 256:  # cuts inside strings are rare: this many in a row is malformed input
                raise self._fail(f"malformed JSON in traceEvents near byte {self.base + i}")

    def _finish(self, after: bytes) -> None:
        """Decode what follows the array: the rest of the top-level object (traceName, ...)."""
        tail = (bytes(after) + self.reader.rest()).strip(_WS)
        if self.bare:
            if tail:
                raise self._fail("malformed JSON after the event array")
            return
        if not tail:
            raise self._fail("truncated trace: the file ends right after traceEvents")
        if tail == b"}":
            return
        if tail.startswith(b","):
            tail = tail[1:]
        try:
            trailer = msgspec.json.decode(b"{" + tail)
        except msgspec.DecodeError:
            raise self._fail("truncated or malformed JSON after traceEvents") from None
        self.trailer = trailer if isinstance(trailer, dict) else {}

    bare = False  # Chrome's bare-array form


# ---------------------------------------------------------------------------------------------
class SymbolTable:
    """Names stored once; events hold their index. Rules compare ints, not strings."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.ids: dict[str, int] = {}
        self._codes: dict[Any, int] = {None: -1}  # ids, plus None and non-str spellings seen

    def intern_many(self, values: list[Any]) -> np.ndarray:
        """Codes for a list of strings (None -> -1), interning new ones. One dict lookup per value
        in C (map); the Python loop runs only over values not seen before (a trace has a few
        thousand distinct names among millions of events)."""
        if not values:
            return np.empty(0, dtype=np.int32)
        codes = np.fromiter(map(self._codes.get, values, repeat(-2)), dtype=np.int32, count=len(values))
        miss = np.flatnonzero(codes == -2).tolist()
        if miss:
            unseen = list(map(values.__getitem__, miss))
            for v in dict.fromkeys(unseen):  # distinct, in order of first appearance
                s = v if isinstance(v, str) else str(v)
                c = self.ids.get(s)
                if c is None:
                    c = self.ids[s] = len(self.names)
                    self.names.append(s)
                self._codes[v] = c
            codes[miss] = np.fromiter(map(self._codes.__getitem__, unseen), dtype=np.int32, count=len(miss))
        return codes

    def id(self, name: str) -> int:
        """The code of a name, or -1 when the trace never uses it."""
        return self.ids.get(name, -1)

    def matching(self, pattern: str | re.Pattern[str]) -> np.ndarray:
        """Codes of every name the regex finds (re.search)."""
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        return np.array([i for i, n in enumerate(self.names) if rx.search(n)], dtype=np.int32)

    def __getitem__(self, code: int) -> str:
        return self.names[code] if code >= 0 else ""

    def __len__(self) -> int:
        return len(self.names)


def _int_column(values: list[Any]) -> np.ndarray:
    try:
        return np.fromiter(values, dtype=np.int64, count=len(values))
    except (TypeError, OverflowError):
        out = np.array([v if isinstance(v, int) and -(1 << 62) < v < (1 << 62) else -1 for v in values],
                       dtype=np.int64)
        return out


def _nullable_int(values: list[Any]) -> np.ndarray:
    """Ints with None -> -1."""
    return _int_column([-1 if v is None else v for v in values])


def _arg_column(args: Any, attr: str) -> np.ndarray:
    """One numeric args field as int64 (-1 when absent), straight from the Structs."""
    getter = operator.attrgetter(attr)
    try:
        return np.fromiter(map(getter, args), dtype=np.int64, count=len(args))
    except (TypeError, OverflowError):  # an explicit null, or a value beyond int64
        return _nullable_int(list(map(getter, args)))


class _Columns:
    """Accumulates per-chunk numpy columns, concatenated once at the end."""


    def __init__(self, symbols: SymbolTable):
        self.symbols = symbols
        self.parts: dict[str, list[np.ndarray]] = {}
        self.flow_parts: dict[str, list[np.ndarray]] = {}
        self.meta: list[_Event] = []
        self._ids: dict[str, int] = {}  # non-numeric pid/tid strings -> negative ids
        self._cat_table = np.empty(0, dtype=np.int8)

    def _norm_id(self, v: int | str) -> int:
        if type(v) is int:
            return v
        got = self._ids.get(v)  # type: ignore[arg-type]
        if got is None:
            s = str(v).strip()
            if s.isdigit() or (s[:1] == "-" and s[1:].isdigit()):
                got = int(s)
            elif s.startswith("stream ") and s[7:].strip().isdigit():
                got = int(s[7:])
            else:  # a label like "Spans": a stable negative id, the same however the file was chunked
                got = -1000 - (zlib.crc32(s.encode()) & 0x3FFFFFFF)
            self._ids[v] = got  # type: ignore[index]
        return got

    def _id_column(self, values: list[int | str]) -> np.ndarray:
        """pid/tid as int64: straight from ints; strings ("stream 7", "25738", "Spans") normalised."""
        # ids.get(v, v): a string seen before -> its number, an int -> itself; one pass in C.
        ids = self._ids
        try:
            return np.fromiter(map(ids.get, values, values), dtype=np.int64, count=len(values))
        except (TypeError, ValueError, OverflowError):  # a string not seen before, or a huge int
            for v in {v for v in values if type(v) is not int} - ids.keys():
                self._norm_id(v)  # each distinct string normalised once
            return _int_column([v if type(v) is int else ids[v] for v in values])

    def _cat_codes(self, raw_codes: np.ndarray) -> np.ndarray:
        """Normalised category per event from the raw category's symbol code (a table lookup)."""
        table = self._cat_table
        if len(table) < len(self.symbols):
            extra = [CAT.get(_RAW_CATEGORY.get(self.symbols[i].lower(), "other"), 0)
                     for i in range(len(table), len(self.symbols))]
            table = self._cat_table = np.concatenate([table, np.asarray(extra, dtype=np.int8)])
        return table[raw_codes].astype(np.int8)  # -1 (no cat) reads the last entry: fixed below

    def add(self, events: list[_Event], has_stacks: bool = True) -> None:
        # Fields are read with list comprehensions (the interpreter's specialised attribute loads
        # beat map(attrgetter)) and rows are picked with itertools.compress, never through numpy
        # object arrays, whose element-wise fill costs ~150 ns an event.
        kind = np.fromiter(map(_PHASE_KIND.get, [e.ph for e in events], repeat(0)), dtype=np.int8,
                           count=len(events))
        is_body = (kind == 1) | (kind == 4)
        body: list[_Event] = events if is_body.all() else list(compress(events, is_body.tolist()))
        if (kind == 3).any():
            self.meta.extend(compress(events, (kind == 3).tolist()))
        if (kind == 2).any():
            flows = list(compress(events, (kind == 2).tolist()))
            norm = self._norm_id
            ids = [-1 if e.id is None else (e.id if type(e.id) is int else norm(e.id)) for e in flows]
            self._put(self.flow_parts, "id", _int_column(ids))
            self._put(self.flow_parts, "start", np.fromiter([e.ph == "s" for e in flows], dtype=bool, count=len(flows)))
            self._put(self.flow_parts, "pid", self._id_column([e.pid for e in flows]))
            self._put(self.flow_parts, "tid", self._id_column([e.tid for e in flows]))
            self._put(self.flow_parts, "ts", np.fromiter([e.ts for e in flows], dtype=np.float64, count=len(flows)))
            self._put(self.flow_parts, "cat", self.symbols.intern_many([e.cat for e in flows]))
        if not body:
            return
        n = len(body)
        raw_cat = self.symbols.intern_many([e.cat for e in body])
        cats = self._cat_codes(np.maximum(raw_cat, 0)) if len(self.symbols) else np.zeros(n, np.int8)
        cats[raw_cat < 0] = 0
        name_codes = self.symbols.intern_many([e.name for e in body])
        instant = kind[is_body] == 4
        memory = name_codes == self.symbols.id("[memory]")
        cats[instant & memory] = CAT["memory"]
        cats[instant & ~memory & (cats == 0)] = CAT["instant"]
        put = self.parts
        self._put(put, "cat", cats)
        self._put(put, "raw_cat", raw_cat)
        self._put(put, "name", name_codes)
        self._put(put, "instant", instant)
        self._put(put, "pid", self._id_column([e.pid for e in body]))
        self._put(put, "tid", self._id_column([e.tid for e in body]))
        self._put(put, "ts", np.fromiter([e.ts for e in body], dtype=np.float64, count=n))
        self._put(put, "dur", np.fromiter([e.dur for e in body], dtype=np.float64, count=n))
        # Args are decoded only for the rows some column reads (launches, GPU work, memory events,
        # and operators when the chunk carries old-schema call stacks), in one batch.
        launch_gpu = np.isin(cats, LAUNCH_SIDE + GPU_SIDE + (CAT["gpu_annotation"],))
        memory = cats == CAT["memory"]
        ops = np.isin(cats, (CAT["cpu_op"], CAT["annotation"])) if has_stacks else np.zeros(n, dtype=bool)
        need = np.flatnonzero(launch_gpu | memory | ops)
        decoded = np.fromiter(_decode_args([body[i].args for i in need.tolist()]), dtype=object, count=len(need))
        pos = np.full(n, -1, dtype=np.int64)
        pos[need] = np.arange(len(need))

        def column(mask: np.ndarray, attr: str) -> np.ndarray:
            out = np.full(n, -1, dtype=np.int64)
            rows = np.flatnonzero(mask)
            if len(rows):
                out[rows] = _arg_column(decoded[pos[rows]], attr)
            return out

        gpu = np.isin(cats, GPU_SIDE + (CAT["gpu_annotation"],))
        self._put(put, "external_id", np.maximum(column(launch_gpu, "external_id"),
                                                 column(launch_gpu, "external_id_old")))
        self._put(put, "correlation", column(launch_gpu, "correlation"))
        self._put(put, "bytes", np.maximum(column(gpu, "bytes"), column(memory, "mem_bytes")))
        self._put(put, "stream", column(gpu, "stream"))
        self._put(put, "device", column(gpu, "device"))
        self._put(put, "total_allocated", column(memory, "total_allocated"))
        self._put(put, "device_type", column(memory, "device_type"))
        self._put(put, "stack", self._subset_symbols(decoded, pos[np.flatnonzero(ops)], np.flatnonzero(ops),
                                                     "call_stack", n))
        sync = np.flatnonzero(cats == CAT["sync"])
        self._put(put, "sync_kind", self._subset_symbols(decoded, pos[sync], sync, "sync_kind", n))

    def _subset_symbols(self, decoded: np.ndarray, at: np.ndarray, rows: np.ndarray, attr: str, n: int) -> np.ndarray:
        """A string args field as symbol codes for `rows` (decoded args at positions `at`)."""
        out = np.full(n, -1, dtype=np.int32)
        if len(rows):
            values = list(map(operator.attrgetter(attr), decoded[at]))
            if any(v is not None for v in values):
                out[rows] = self.symbols.intern_many(values)
        return out

    @staticmethod
    def _put(store: dict[str, list[np.ndarray]], key: str, arr: np.ndarray) -> None:
        store.setdefault(key, []).append(arr)

    def frames(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        def build(parts: dict[str, list[np.ndarray]]) -> pd.DataFrame:
            cols = {}
            for k in list(parts):
                chunks = parts.pop(k)
                cols[k] = np.concatenate(chunks) if len(chunks) > 1 else chunks[0]
            return pd.DataFrame(cols, copy=False)

        events = build(self.parts) if self.parts else _empty_events()
        flows = build(self.flow_parts) if self.flow_parts else pd.DataFrame(
            {"id": np.empty(0, np.int64), "start": np.empty(0, bool), "pid": np.empty(0, np.int64),
             "tid": np.empty(0, np.int64), "ts": np.empty(0, np.float64), "cat": np.empty(0, np.int32)})
        return events, flows


_EVENT_DTYPES = {"cat": np.int8, "raw_cat": np.int32, "name": np.int32, "instant": bool, "pid": np.int64,
                 "tid": np.int64, "ts": np.float64, "dur": np.float64, "external_id": np.int64,
                 "correlation": np.int64, "bytes": np.int64, "stream": np.int64, "device": np.int64,
                 "total_allocated": np.int64,
                 "device_type": np.int64, "stack": np.int32, "sync_kind": np.int32}


def _empty_events() -> pd.DataFrame:
    return pd.DataFrame({k: np.empty(0, dtype=v) for k, v in _EVENT_DTYPES.items()})


# ---------------------------------------------------------------------------------------------
def _thread_time_order(pid: np.ndarray, tid: np.ndarray, ts: np.ndarray, dur: np.ndarray) -> np.ndarray:
    """Indices sorted by (thread, start, longest first), as np.lexsort((-dur, ts, tid, pid)) would
    group them, but fast on traces already in time order: a stable sort by start (nearly sorted
    input), a re-sort of equal-start runs only, then a stable sort by a dense thread code."""
    order = np.argsort(ts, kind="stable")
    sorted_ts = ts[order]
    tie = np.flatnonzero(sorted_ts[1:] == sorted_ts[:-1])
    if len(tie):
        in_run = np.zeros(len(order), dtype=bool)
        in_run[tie] = True
        in_run[tie + 1] = True
        at = np.flatnonzero(in_run)
        sub = order[at]
        order[at] = sub[np.lexsort((-dur[sub], ts[sub]))]
    pcode, _ = pd.factorize(pid)
    tcode, tuniq = pd.factorize(tid)
    thread = pcode.astype(np.int64) * max(len(tuniq), 1) + tcode
    return order[np.argsort(thread[order], kind="stable")]


def _nest(events: pd.DataFrame) -> np.ndarray:
    """Row of the innermost CPU event enclosing each CPU event on the same thread (-1: none).

    Host events (ops, annotations, Python frames, runtime calls) form a call tree per thread. In
    (thread, start, longest-first) order, the parent of an event is the nearest earlier event on
    its thread that is still open when it starts (end > start): exactly the top of the stack a
    sweep would keep, found here by pointer jumping in numpy (O(n log n), no Python loop). An event
    that starts exactly when another ends is its sibling, not its child.
    """
    parent = np.full(len(events), -1, dtype=np.int64)
    cpu = np.flatnonzero(np.isin(events["cat"].to_numpy(), CPU_NESTING) & ~events["instant"].to_numpy())
    if not len(cpu):
        return parent
    ts_all, dur_all = events["ts"].to_numpy()[cpu], events["dur"].to_numpy()[cpu]
    pid, tid = events["pid"].to_numpy()[cpu], events["tid"].to_numpy()[cpu]
    order = _thread_time_order(pid, tid, ts_all, dur_all)
    ts, end = ts_all[order], (ts_all + dur_all)[order]
    thread_start = np.ones(len(order), dtype=bool)
    thread_start[1:] = (pid[order][1:] != pid[order][:-1]) | (tid[order][1:] != tid[order][:-1])
    idx = np.arange(len(order))
    # cur[i]: a candidate such that every event strictly between it and i has ended by ts[i]
    cur = idx - 1
    cur[thread_start] = -1
    active = idx[cur >= 0]
    while len(active):
        c = cur[active]
        active = active[end[c] <= ts[active]]  # candidate already ended: keep jumping
        # everything the candidate skipped ended by its own start <= ts[i]: jump past it as well
        cur[active] = cur[cur[active]]
        active = active[cur[active] >= 0]
    found = cur >= 0
    rows = cpu[order]
    parent[rows[found]] = rows[cur[found]]
    return parent


def _links(events: pd.DataFrame) -> np.ndarray:
    """Runtime/driver call <-> the GPU work it launched, through the CUPTI correlation id.

    For a GPU-side row: the row of the launching call. For a launching call: its first GPU row.
    """
    link = np.full(len(events), -1, dtype=np.int64)
    cat = events["cat"].to_numpy()
    corr = events["correlation"].to_numpy()
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
        by_start = np.lexsort((events["ts"].to_numpy()[g], owner))
        owner_sorted = owner[by_start]
        first = np.ones(len(owner_sorted), dtype=bool)
        first[1:] = owner_sorted[1:] != owner_sorted[:-1]
        link[owner_sorted[first]] = g[by_start][first]
    return link


# ---------------------------------------------------------------------------------------------
@dataclass
class Trace:
    """One parsed profiler trace: metadata, an events frame, flows, and the symbol table.

    `events` columns: cat (index into CATEGORIES), raw_cat and name (symbol codes), instant, pid,
    tid (ints; "stream 7" -> 7), ts/dur/end (microseconds). From args, -1 when absent and read
    only where a rule uses them: external_id and correlation (launch calls and GPU rows), bytes,
    stream, device (GPU rows; bytes also for `[memory]`), total_allocated and device_type
    (`[memory]`), stack (symbol of the old-schema `Call stack` of operators), sync_kind (symbol,
    `cuda_sync` rows). Derived once at load: parent (row of the enclosing host event on the same
    thread: operators, annotations, Python frames), link (launch call <-> GPU row, by correlation)
    and step (ProfilerStep number, -1 outside any step). Rows are in file order; flow events
    (`ac2g`, `async`, `fwdbwd`) are in `flows`, process and thread names in `processes`.
    """

    path: Path
    metadata: dict[str, Any]
    events: pd.DataFrame
    flows: pd.DataFrame
    symbols: SymbolTable
    processes: dict[int, dict[str, Any]] = field(default_factory=dict)
    schema: str = "new"  # "old" for torch<=1.9 Kineto categories (Operator, Runtime, Kernel)

    def col(self, name: str) -> np.ndarray:
        """A column of `events` as a numpy array, cached: pandas column access costs microseconds,
        and attribution walks touch columns thousands of times."""
        cache: dict[str, np.ndarray] = self.__dict__.setdefault("_cols", {})
        arr = cache.get(name)
        if arr is None:
            arr = cache[name] = self.events[name].to_numpy()
        return arr

    # -- metadata ------------------------------------------------------------------------------
    @property
    def device_properties(self) -> list[dict[str, Any]]:
        props = self.metadata.get("deviceProperties")
        return [p for p in props if isinstance(p, dict)] if isinstance(props, list) else []

    def device(self, index: int = 0) -> dict[str, Any] | None:
        for p in self.device_properties:
            if p.get("id") == index:
                return p
        return None

    @property
    def distributed_info(self) -> dict[str, Any]:
        info = self.metadata.get("distributedInfo")
        return info if isinstance(info, dict) else {}

    # -- selection helpers ---------------------------------------------------------------------
    def of(self, *categories: str) -> pd.DataFrame:
        """Rows of the given normalised categories (see CATEGORIES)."""
        codes = [CAT[c] for c in categories]
        return self.events[self.events["cat"].isin(codes)]

    def named(self, names: list[str] | tuple[str, ...] | str, frame: pd.DataFrame | None = None) -> pd.DataFrame:
        """Rows whose name is one of `names`."""
        frame = self.events if frame is None else frame
        wanted = [names] if isinstance(names, str) else list(names)
        codes = [c for c in (self.symbols.id(n) for n in wanted) if c >= 0]
        return frame[frame["name"].isin(codes)]

    def matching(self, pattern: str | re.Pattern[str], frame: pd.DataFrame | None = None) -> pd.DataFrame:
        """Rows whose name the regex finds."""
        frame = self.events if frame is None else frame
        return frame[frame["name"].isin(self.symbols.matching(pattern))]

    def name(self, row: int) -> str:
        return self.symbols[int(self.col("name")[row])]

    def names(self, frame: pd.DataFrame) -> list[str]:
        return [self.symbols[int(c)] for c in frame["name"].to_numpy()]

    # -- operator table --------------------------------------------------------------------------
    def top_ops(self, limit: int = 20) -> list[dict[str, Any]]:
        """Operators by self time (their time minus the operators and runtime calls nested in
        them), as the profiler's `key_averages()` table has them: [{"name", "count", "self_ms",
        "total_ms"}]. Computed from the columns in milliseconds; the profiler's own table of a
        window recorded with stacks and shapes costs seconds in the audited process."""
        cat, dur, parent, name = self.col("cat"), self.col("dur"), self.col("parent"), self.col("name")
        ops = np.flatnonzero((cat == CAT["cpu_op"]) & ~self.col("instant"))
        if not len(ops):
            return []
        nested = np.flatnonzero(np.isin(cat, (CAT["cpu_op"], CAT["runtime"], CAT["driver"])) & (parent >= 0))
        inner = np.bincount(parent[nested], weights=dur[nested], minlength=len(cat))
        codes, which = np.unique(name[ops], return_inverse=True)
        count = np.bincount(which)
        self_us = np.bincount(which, weights=np.maximum(dur[ops] - inner[ops], 0.0))
        total_us = np.bincount(which, weights=dur[ops])
        order = np.argsort(-self_us, kind="stable")[:limit]
        return [{"name": self.symbols[int(codes[i])], "count": int(count[i]), "self_ms": float(self_us[i]) / 1e3,
                 "total_ms": float(total_us[i]) / 1e3} for i in order]

    # -- steps and windows ---------------------------------------------------------------------
    @property
    def steps(self) -> pd.DataFrame:
        """The CPU-side ProfilerStep ranges: step number, ts, end, dur (us), in time order."""
        cached = self.__dict__.get("_steps")
        if cached is not None:
            return cached
        ev = self.events
        codes = self.symbols.matching(STEP_NAME)
        sel = ev[ev["name"].isin(codes) & ev["cat"].isin((CAT["annotation"], CAT["cpu_op"]))
                 & ~ev["instant"]]
        numbers = [int(STEP_NAME.match(self.symbols[int(c)]).group(1)) for c in sel["name"]]  # type: ignore[union-attr]
        steps = pd.DataFrame({"step": np.asarray(numbers, dtype=np.int64), "row": sel.index.to_numpy(),
                              "ts": sel["ts"].to_numpy(), "end": sel["end"].to_numpy(),
                              "dur": sel["dur"].to_numpy()}).sort_values("ts").reset_index(drop=True)
        self.__dict__["_steps"] = steps
        return steps

    def window(self) -> tuple[float, float]:
        """The span rules measure shares against: the ProfilerSteps, or the whole trace."""
        steps = self.steps
        if len(steps):
            return float(steps["ts"].min()), float(steps["end"].max())
        ev = self.events[self.events["cat"].isin(CPU_NESTING + GPU_WORK)]
        if not len(ev):
            return 0.0, 0.0
        return float(ev["ts"].min()), float(ev["end"].max())

    def step_count(self) -> int:
        return max(1, len(self.steps))

    def step_ms(self) -> float:
        """Mean wall time of one step in ms (the whole window when there are no ProfilerSteps)."""
        lo, hi = self.window()
        return (hi - lo) / 1000.0 / self.step_count()

    # -- attribution ---------------------------------------------------------------------------
    def ancestors(self, row: int) -> list[int]:
        """Enclosing CPU events of a row, innermost first (for a GPU row: of its launch call)."""
        parent = self.col("parent")
        link = self.col("link")
        cat = int(self.col("cat")[row])
        if cat in GPU_SIDE and link[row] >= 0:
            row = int(link[row])
        out: list[int] = []
        seen = set()
        p = int(parent[row])
        while p >= 0 and p not in seen:
            out.append(p)
            seen.add(p)
            p = int(parent[p])
        return out

    def op_chain(self, row: int) -> list[str]:
        """Names of the enclosing operators (cpu_op), innermost first."""
        cat = self.col("cat")
        return [self.name(r) for r in self.ancestors(row) if cat[r] == CAT["cpu_op"]]

    @property
    def has_stacks(self) -> bool:
        ev = self.events
        return bool((ev["cat"] == CAT["python"]).any() or (ev["stack"] >= 0).any())

    def frames(self, row: int) -> list[Frame]:
        """Python frames around a row, innermost first: Python events, else the old Call stack."""
        cat = self.col("cat")
        stack = self.col("stack")
        chain = [row, *self.ancestors(row)]
        out: list[Frame] = []
        for r in chain:
            if cat[r] == CAT["python"]:
                f = parse_frame(self.name(r))
                if f is not None:
                    out.append(f)
        if out:
            return out
        for r in chain:
            if stack[r] >= 0:
                for part in self.symbols[int(stack[r])].split(";"):
                    f = parse_frame(part)
                    if f is not None:
                        out.append(f)
                return out
        return out

    def user_frame(self, row: int) -> Frame | None:
        """The innermost frame outside torch, the standard library and site-packages.

        Memoised per row: every row on a walked chain gets the answer, so attributing thousands
        of kernels costs one walk per distinct call site.
        """
        cache: dict[int, Frame | None] = self.__dict__.setdefault("_user_frames", {})
        cat = self.col("cat")
        link = self.col("link")
        if cat[row] in GPU_SIDE and link[row] >= 0:
            row = int(link[row])
        parent = self.col("parent")
        stack = self.col("stack")
        names = self.col("name")
        path: list[int] = []
        found: Frame | None = None
        r = row
        while r >= 0:
            if r in cache:
                found = cache[r]
                break
            path.append(r)
            if cat[r] == CAT["python"]:
                f = parse_frame(self.symbols[int(names[r])])
                if f is not None and not is_library_file(f.file):
                    found = f
                    break
            elif stack[r] >= 0:
                for part in self.symbols[int(stack[r])].split(";"):
                    f = parse_frame(part)
                    if f is not None and not is_library_file(f.file):
                        found = f
                        break
                break
            r = int(parent[r])
            if len(path) > 10_000:  # a cycle cannot happen by construction; stay safe anyway
                break
        for p in path:
            cache[p] = found
        return found


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


def _finish(path: Path, stream: _Stream, cols: _Columns, symbols: SymbolTable) -> Trace:
    events, flows = cols.frames()
    _release_freed_memory()
    events["end"] = events["ts"] + events["dur"]
    events["parent"] = _nest(events)
    events["link"] = _links(events)
    trace_meta = {**stream.header, **stream.trailer}
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
    old = bool(len(events)) and any(symbols.id(c) >= 0 for c in ("Operator", "Runtime", "Kernel"))
    trace = Trace(path=path, metadata=trace_meta, events=events, flows=flows, symbols=symbols,
                  processes=processes, schema="old" if old else "new")
    events["step"] = _assign_steps(trace)
    return trace


def _assign_steps(trace: Trace) -> np.ndarray:
    """ProfilerStep number of each row: CPU rows by time, GPU rows by the step of their launch."""
    ev = trace.events
    out = np.full(len(ev), -1, dtype=np.int64)
    steps = trace.steps
    if not len(steps) or not len(ev):
        return out
    starts = steps["ts"].to_numpy()
    ends = steps["end"].to_numpy()
    nums = steps["step"].to_numpy()
    ts = ev["ts"].to_numpy()
    k = np.searchsorted(starts, ts, side="right") - 1
    ok = (k >= 0) & (ts < ends[np.maximum(k, 0)])
    out[ok] = nums[k[ok]]
    cat = ev["cat"].to_numpy()
    link = ev["link"].to_numpy()
    gpu = np.isin(cat, GPU_SIDE) & (link >= 0)
    out[gpu] = out[link[gpu]]
    return out


def load_trace(path: Path | str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Trace:
    """Parse a Kineto/Chrome trace (`.json` or `.json.gz`) with bounded memory.

    Raises InputError, with one line naming the file, for missing, truncated, malformed or
    non-trace inputs.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such trace file")
    symbols = SymbolTable()
    cols = _Columns(symbols)
    stream = _Stream(path, chunk_bytes)
    # No cyclic garbage collection while parsing: millions of short-lived lists and arrays would
    # trigger full collections that walk every object of the process (plotly, pandas...) again and
    # again, for cycles the parser never makes.
    collecting = gc.isenabled()
    gc.disable()
    try:
        stream.start()
        for events, has_stacks in stream.chunks():
            cols.add(events, has_stacks)
        return _finish(path, stream, cols, symbols)
    finally:
        stream.reader.close()
        if collecting:
            gc.enable()


# ---------------------------------------------------------------------------------------------
# Interval arithmetic shared by the trace rules (busy time, idle gaps, overlaps).
def merge_intervals(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of intervals as sorted, disjoint (start, end) arrays."""
    starts = np.asarray(starts, dtype=np.float64)
    ends = np.asarray(ends, dtype=np.float64)
    keep = ends > starts
    starts, ends = starts[keep], ends[keep]
    if not len(starts):
        return starts, ends
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    run_end = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > run_end[:-1]
    first = np.flatnonzero(new)
    last = np.r_[first[1:] - 1, len(s) - 1]
    return s[first], run_end[last]


def total_length(iv: tuple[np.ndarray, np.ndarray]) -> float:
    return float((iv[1] - iv[0]).sum())


def intersect(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Intersection of two merged interval sets."""
    (s1, e1), (s2, e2) = a, b
    if not len(s1) or not len(s2):
        return np.empty(0), np.empty(0)
    # for each interval of a, the b intervals that may overlap it
    lo = np.searchsorted(e2, s1, side="right")
    hi = np.searchsorted(s2, e1, side="left")
    counts = np.maximum(hi - lo, 0)
    if not counts.sum():
        return np.empty(0), np.empty(0)
    ia = np.repeat(np.arange(len(s1)), counts)
    offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    ib = np.repeat(lo, counts) + offsets
    s = np.maximum(s1[ia], s2[ib])
    e = np.minimum(e1[ia], e2[ib])
    keep = e > s
    return s[keep], e[keep]


def subtract(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Parts of merged set `a` not covered by merged set `b`."""
    s1, e1 = a
    if not len(s1) or not len(b[0]):
        return a
    lo, hi = float(min(s1.min(), b[0].min())) - 1.0, float(max(e1.max(), b[1].max())) + 1.0
    # complement of b within [lo, hi], then intersect
    cs = np.r_[lo, b[1]]
    ce = np.r_[b[0], hi]
    return intersect(a, merge_intervals(cs, ce))


def clip(iv: tuple[np.ndarray, np.ndarray], lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    return merge_intervals(np.clip(iv[0], lo, hi), np.clip(iv[1], lo, hi))


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpy2D", "cudaMemcpy3D", "cudaMemcpyFromSymbol", "cudaMemcpyToSymbol",
              "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH_v2",
              "cuMemcpyDtoH", "hipStreamSynchronize", "hipDeviceSynchronize", "hipEventSynchronize",
              "hipMemcpy")
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
    """Merged intervals when any GPU stream runs a kernel, copy or memset (clipped to [lo, hi])."""
    ev = trace.events
    g = ev[ev["cat"].isin(GPU_WORK)]
    iv = merge_intervals(g["ts"].to_numpy(), g["end"].to_numpy())
    if lo is not None and hi is not None:
        iv = clip(iv, lo, hi)
    return iv


def frame_location_parts(frame: Frame) -> tuple[str, int, str]:
    """(file, line, source line) for a Location; the source only when the file is on this disk."""
    import linecache

    code = linecache.getline(frame.file, frame.line).strip() if frame.file else ""
    return frame.file, frame.line, code


def sites(trace: Trace, rows: list[int] | np.ndarray, weights: list[float] | np.ndarray | None = None,
          limit: int = 5) -> list[tuple[Frame, int, float]]:
    """User frames behind rows, grouped: [(frame, count, summed weight)], heaviest first."""
    acc: dict[tuple[str, int], list[Any]] = {}
    w = np.ones(len(rows)) if weights is None else np.asarray(weights, dtype=np.float64)
    for r, x in zip(rows, w):
        f = trace.user_frame(int(r))
        if f is None:
            continue
        key = (f.file, f.line)
        slot = acc.setdefault(key, [f, 0, 0.0])
        slot[1] += 1
        slot[2] += float(x)
    out = sorted(((f, n, s) for f, n, s in acc.values()), key=lambda t: (-t[2], -t[1]))
    return out[:limit]
