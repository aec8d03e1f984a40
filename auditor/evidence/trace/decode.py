"""Stream a PyTorch profiler (Kineto) Chrome trace into typed events: with the columns made of them
(auditor.evidence.trace.columns), the half of the parser that needs neither pandas nor the rules, so
that worker processes can run it (see auditor.evidence.trace.parallel).

The `traceEvents` array is cut into chunks on top-level object boundaries, each chunk is decoded by
msgspec into typed Structs naming only the fields the rules read (every other key, and most of
`args`, is skipped in C), and turned at once into numpy columns, names interned as ints in a
symbol table. auditor.evidence.trace.load builds the frames, derived columns and the Trace from them.
"""
from __future__ import annotations

import gzip
import math
import re
import zlib
from collections.abc import Iterator
from itertools import repeat
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np

from auditor.evidence.errors import InputError

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
    decoded, in one batch per chunk (see auditor.evidence.trace.columns)."""

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
    expected, a null name): decoded loosely, then coerced field by field in Python (_coerce).
    UNSET: the key is absent, which is not the same as a value of the wrong type."""

    ph: Any = msgspec.UNSET
    name: Any = msgspec.UNSET
    cat: Any = msgspec.UNSET
    pid: Any = msgspec.UNSET
    tid: Any = msgspec.UNSET
    ts: Any = msgspec.UNSET
    dur: Any = msgspec.UNSET
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


class Vocabulary:
    """The names and categories of the events decoded so far, and a decoder that reads those
    values as the very str objects seen first (a Literal of them), not as new strings: their hash
    is then computed once and a lookup compares them by identity, which on a trace's few thousand
    names repeated millions of times saves ~100 ns of each event's columns (~10% of the parse).

    A chunk holding a value not learnt yet (a new operator) fails that decoder part way and is
    decoded again with the plain one (_DECODER), whose values are then learnt: a miss costs about
    half a chunk's decode, a hit saves about a sixth of one. So after a miss the next chunks are
    decoded plainly and learnt from (1, then 2, 4... up to MAX_WAIT after misses in a row: a first
    step brings new names in most of its chunks), and a trace of more than MAX_WORDS names is
    decoded plainly from then on."""

    MAX_WORDS = 1 << 15
    STEPS_AHEAD = 256  # a ProfilerStep#N learnt: the names of the next steps as well
    MAX_WAIT = 16

    def __init__(self) -> None:
        self.names: dict[str, None] = {}
        self.cats: dict[str, None] = {}
        self.decoder: msgspec.json.Decoder | None = None
        self.stale = False  # words learnt since the decoder was made
        self.wait = 0  # chunks to decode plainly before the next try
        self.backoff = 1
        self.tries = self.misses = 0
        self.off = False

    def decode(self, piece: memoryview) -> list[_Event]:
        """The events of a JSON array of events; raises what _DECODER raises on them."""
        if self.wait:
            self.wait -= 1
        elif self.names and not self.off:
            if self.stale:
                self._make()
            self.tries += 1
            try:
                events = self.decoder.decode(piece)  # type: ignore[union-attr]
                self.backoff = 1
                return events
            except msgspec.ValidationError:  # a value it was not given, or one of the wrong type
                self.misses += 1
                self.wait, self.backoff = self.backoff, min(2 * self.backoff, self.MAX_WAIT)
        events = _DECODER.decode(piece)
        if not self.off:
            self._learn(events)
        return events

    def _learn(self, events: list[_Event]) -> None:
        """Add the events' new names and categories (the decoder that knows them is made when next tried)."""
        names = {e.name for e in events}.difference(self.names)
        cats = {e.cat for e in events}.difference(self.cats)
        if not names and not cats:
            return
        for name in [n for n in names if STEP_NAME.match(n)]:  # steps are numbered up: the next ones too
            number = int(name[13:])
            names.update(f"ProfilerStep#{k}" for k in range(number + 1, number + self.STEPS_AHEAD))
        self.names.update(dict.fromkeys(names))
        self.cats.update(dict.fromkeys(cats))
        self.stale = True
        if len(self.names) > self.MAX_WORDS:
            self.off, self.decoder = True, None

    def _make(self) -> None:
        known = {"name": Literal[tuple(self.names)], "cat": Literal[tuple(self.cats)]}  # type: ignore[valid-type]
        fields = [(f.name, known.get(f.name, f.type), f.default) for f in msgspec.structs.fields(_Event)]
        self.decoder = msgspec.json.Decoder(list[msgspec.defstruct("_KnownEvent", fields, gc=False)])  # type: ignore[misc]
        self.stale = False


def _to_int(v: Any) -> int | None:
    """An int from a number or a numeric string; None for anything else, "inf" and "nan" included."""
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
            except (ValueError, OverflowError):
                return None
    return None


def _to_float(v: Any, default: float) -> float:
    """A finite float from a number or a numeric string; `default` for anything else: a value past
    the float range (10**400), "inf" or "nan" is a value of the wrong type."""
    if isinstance(v, bool) or v is None:
        return default
    try:
        got = float(v) if isinstance(v, (int, float, str)) else default
    except (ValueError, OverflowError):
        return default
    return got if math.isfinite(got) else default


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


_BAD = object()  # a field's value of the wrong type (_coerce)


def _coerce_id(v: Any) -> Any:
    """A pid/tid: an int or a label string as they are, an integral float as an int; absent or
    null: -1 (none); anything else (a list, an object, true) is of the wrong type."""
    if v is msgspec.UNSET or v is None:
        return -1
    if isinstance(v, bool):
        return _BAD
    if isinstance(v, (int, str)):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return _BAD


def _coerce_time(v: Any, absent: float) -> float | object:
    """A ts/dur: a number, or a string that reads as one; absent: `absent`."""
    if v is msgspec.UNSET:
        return absent
    got = _to_float(v, math.nan)
    return _BAD if math.isnan(got) else got


# The most bytes one event can take: a profiler's events are a few KiB (a Python frame's, an op's
# shapes). Bytes that run on further without an event ending (`[{` then gigabytes of zeros) are
# refused when they pass this, not read to the end of a multi-GB file first.
MAX_EVENT_BYTES = 64 << 20


def too_long(at: int) -> str:
    return (f"malformed JSON in traceEvents near byte {at}: no event ends within "
            f"{MAX_EVENT_BYTES >> 20} MiB of it")


# The longest duration an event of a profiled window can have, in µs: a week. One longer (1e300, a
# negative one) is no measurement: kept, it would make the GPU "busy" for the whole trace.
MAX_DUR_US = 7 * 24 * 3600 * 1e6


def _coerce(loose: _LooseEvent) -> _Event | str:
    """The typed event, or, when a field it needs has a value of the wrong type (a list for a tid,
    a word for a time) or one that cannot be (no time, a negative or week-long duration), why it
    cannot be used: `"tid" is [1]`. Such an event is dropped and counted
    (see _Stream.dropped) rather than read with a made-up thread or time, which put a ProfilerStep
    nowhere and reported the trace as empty with no word."""
    ph = "" if loose.ph is msgspec.UNSET else loose.ph
    if not isinstance(ph, str):
        return f'"ph" is {_shown(ph)}'
    kind = _PHASE_KIND.get(ph, 0)
    if kind == 0:
        return _Event(ph=ph)  # (ignored by its phase, whatever else it holds)
    name = "" if loose.name in (msgspec.UNSET, None) else loose.name
    if isinstance(name, (int, float)) and not isinstance(name, bool):
        name = str(name)
    fields: dict[str, Any] = {
        "name": name if isinstance(name, str) else _BAD,
        "cat": "" if loose.cat in (msgspec.UNSET, None) else loose.cat if isinstance(loose.cat, str) else _BAD,
        "pid": _coerce_id(loose.pid), "tid": _coerce_id(loose.tid),
        "ts": _coerce_time(loose.ts, math.nan) if kind != 3 else math.nan,
        "dur": _coerce_time(loose.dur, 0.0) if kind == 1 else 0.0,
    }
    for key, value in fields.items():
        if value is _BAD:
            return f'"{key}" is {_shown(getattr(loose, key))}'
    if kind != 3 and math.isnan(fields["ts"]):
        return '"ts" is missing'
    if not 0.0 <= fields["dur"] <= MAX_DUR_US:
        return f'"dur" is {_shown(loose.dur)}, which no recorded event lasts'
    args = msgspec.Raw(msgspec.json.encode(loose.args)) if isinstance(loose.args, dict) else _EMPTY_RAW
    ident = loose.id if isinstance(loose.id, (int, str)) and not isinstance(loose.id, bool) else None
    return _Event(ph=ph, id=ident, args=args, **fields)


def _shown(value: Any) -> str:
    """A wrong value as JSON, cut short: it goes into a one-line message."""
    text = msgspec.json.encode(value).decode(errors="replace")
    return text if len(text) <= 40 else text[:37] + "..."


# ---------------------------------------------------------------------------------------------
# Streaming the file: blocks of bytes -> header dict, chunks of complete events, trailer dict.
_TRACE_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_BOUNDARY = re.compile(rb"\}\s*(?:,\s*\{|\])")
_WS = b" \t\r\n"
_NON_WS = re.compile(rb"[^ \t\r\n]")


# What a gzip trace may inflate to: at most MAX_INFLATION times the compressed bytes read so far,
# once past INFLATION_FLOOR. Kineto's JSON compresses 7-30x (the fixtures: 30x a V100 ResNet-50
# trace at gzip's default level); a file past 100x is no recording but a bomb (36 MB inflating to
# 10 GB of events grew past 6 GB resident before), refused within its first INFLATION_FLOOR bytes.
MAX_INFLATION = 100
INFLATION_FLOOR = 64 << 20


class _Reader:
    """The file's bytes, gunzipped on the fly when it is gzip (detected by magic; bounded by
    MAX_INFLATION), read straight into the caller's buffer; read errors become one-line InputErrors."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.raw = open(path, "rb")
            magic = self.raw.read(2)
            self.raw.seek(0)
        except OSError as e:
            raise InputError(f"{path}: cannot read ({e.strerror or e})") from None
        self.gzip = magic == b"\x1f\x8b"
        self.stream = gzip.GzipFile(fileobj=self.raw) if self.gzip else self.raw
        self.inflated = 0

    def _bound(self, got: int) -> None:
        """InputError once the gzip has inflated past what a trace compresses to (MAX_INFLATION)."""
        self.inflated += got
        if self.gzip and self.inflated > INFLATION_FLOOR and self.inflated > MAX_INFLATION * self.raw.tell():
            raise InputError(f"{self.path}: not a profiler trace: its first {self.raw.tell():,} compressed bytes "
                             f"inflate to {self.inflated:,}, over {MAX_INFLATION} times as many (a profiler "
                             f"trace compresses 7-30 times)")

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
        except EOFError:  # (a gzip cut short: a full disk, a kill while it was written)
            raise InputError(f"{self.path}: truncated gzip trace (the compressed file ends before its "
                             "end-of-stream marker)") from None
        except (gzip.BadGzipFile, zlib.error) as e:
            raise InputError(f"{self.path}: not a readable gzip trace ({e or 'compressed file ended early'})") from None
        except OSError as e:
            raise InputError(f"{self.path}: cannot read ({e.strerror or e})") from None
        self._bound(got)
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
    decoded from it: their raw `args` point into it.

    Given `data` (a bytearray whose first byte is padding, or a private writable mapping of the file
    with `pos` set past a padding byte), the stream is that text, already in memory, instead of the
    file (the workers of auditor.evidence.trace.parallel); it is still decoded chunk by chunk."""

    def __init__(self, path: Path, chunk_bytes: int, data: bytearray | None = None):
        self.path = path
        self.chunk = max(1 << 16, chunk_bytes)
        self.reader = _Reader(path) if data is None else None
        self.buf = bytearray(b" ") if data is None else data
        self.eof = data is not None
        self.header: dict[str, Any] = {}
        self.trailer: dict[str, Any] = {}
        self.pos = 1  # where unread data starts in buf
        self.base = -1  # buf[j] is byte base + j of the (decompressed) stream
        self.vocabulary = Vocabulary()  # (a worker gives each of its pieces' streams its own)

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

    def chunks(self, timed: bool = True) -> Iterator[list[_Event]]:
        """Decoded lists of events, chunk by chunk, until the closing `]` of the array; those whose
        times cannot be used left out (_timed), unless `timed` is False: then the caller leaves them
        out (Columns.add does, from the columns it reads anyway, calling _timed only when one is).

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
            if self.buf[p:p + 1] != b"{":  # every event is an object: `[1, 2]` is JSON, not a trace
                raise self._fail("not a profiler trace: traceEvents holds a non-object")
            self.pos = p
            events, cut = self._decode_prefix(p, timed)
            if events is None:  # no complete event in the buffer: an event larger than a block
                if len(self.buf) - p > MAX_EVENT_BYTES:
                    raise self._fail(too_long(self.base + p))
                if not self._more():
                    raise self._unfinished(p)
                self.chunk = max(self.chunk, len(self.buf))
                continue
            self.pos = cut
            yield events

    def _unfinished(self, p: int) -> InputError:
        """The error for events that never complete: the file is cut short, or the array holds
        something that is not an event (`[{...}, 2]`). Only the error path reads the rest again."""
        text = b"[" + bytes(self.buf[p:])
        try:
            rest = msgspec.json.decode(text)
        except msgspec.DecodeError as e:
            if "truncated" in str(e):
                return self._fail("truncated trace: the traceEvents array never closes")
            off = _error_offset(e)
            try:  # the array closed and the object goes on: `{"traceEvents": [...], "x": 1}`
                rest = msgspec.json.decode(text[:text.rfind(b"]", 0, off + 1) + 1]) if "trailing" in str(e) and off else None
            except msgspec.DecodeError:
                rest = None
        if isinstance(rest, list) and not all(isinstance(x, dict) for x in rest):
            return self._fail("not a profiler trace: traceEvents holds a non-object")
        return self._fail("malformed JSON in traceEvents")

    def _decode_prefix(self, p: int, timed: bool = True) -> tuple[list[_Event] | None, int]:
        """Decode the longest run of complete events in the buffer from `p`; return them (those with
        usable times, when `timed`) and the offset just past the last one.

        A candidate cut is a `}` followed by `,{` or `]`. A cut inside a string or a nested object
        makes the wrapped chunk fail at its very end, and a cut past the end of the array leaves
        trailing characters, so we step back to an earlier cut; an error earlier in the chunk is
        real malformation.
        """
        buf = self.buf
        end = min(len(buf), p + self.chunk)  # (a buffer given whole is still decoded a chunk at a time)
        whole = end == len(buf)
        tries = 0
        while True:
            i = buf.rfind(b"}", p, end)
            while i >= 0 and not _BOUNDARY.match(buf, i):
                i = buf.rfind(b"}", p, i)
            if i < 0 and not whole:  # no whole event in the first chunk's worth: look further
                end, whole = len(buf), True
                continue
            if i < 0:
                return None, p
            # buf[p - 1] (padding, whitespace, `,` or `[`) and buf[i + 1] (whitespace, `,` or `]`)
            # lie outside every event: they become the brackets of the array decoded in place.
            before, after = buf[p - 1], buf[i + 1]
            buf[p - 1], buf[i + 1] = 0x5B, 0x5D
            piece = memoryview(buf)[p - 1:i + 2]
            try:
                events = self.vocabulary.decode(piece)
                if timed:
                    events = self._timed(events)
            except RecursionError:  # (msgspec's limit: no profiler writes JSON that deep)
                raise self._fail(f"not a profiler trace: an event near byte {self.base + p} nests "
                                 "objects or arrays too deeply") from None
            except msgspec.ValidationError:
                try:
                    events = self._usable(_LOOSE_DECODER.decode(piece))
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

    def _timed(self, events: list[_Event]) -> list[_Event]:
        """The typed events whose times can be used; those without a time (a timed phase with no
        "ts", an infinite one) or with a duration no event has (negative, over MAX_DUR_US) counted
        in `dropped` as _coerce counts a loosely decoded one (one pass in C when all are fine)."""
        n = len(events)
        ts = np.fromiter([e.ts for e in events], dtype=np.float64, count=n)
        dur = np.fromiter([e.dur for e in events], dtype=np.float64, count=n)
        if (np.isfinite(ts) & (dur >= 0) & (dur <= MAX_DUR_US)).all():
            return events
        out: list[_Event] = []
        for e in events:
            kind = _PHASE_KIND.get(e.ph, 0)
            why = None
            if kind not in (0, 3) and not math.isfinite(e.ts):
                why = '"ts" is missing' if math.isnan(e.ts) else f'"ts" is {e.ts!r}'
            elif kind == 1 and not 0.0 <= e.dur <= MAX_DUR_US:
                why = f'"dur" is {e.dur!r}, which no recorded event lasts'
            if why is None:
                out.append(e)
                continue
            if not self.dropped:
                name = e.name if len(e.name) <= 60 else e.name[:57] + "..."
                self.dropped_why = f"{name or 'an event'}: {why}"
            self.dropped += 1
        return out

    def _usable(self, loose: list[_LooseEvent]) -> list[_Event]:
        """The events of a loosely decoded chunk that can be used; the others counted in `dropped`,
        the first one's reason kept in `dropped_why`."""
        out: list[_Event] = []
        for e in loose:
            got = _coerce(e)
            if isinstance(got, str):
                if not self.dropped:
                    name = e.name if isinstance(e.name, str) and e.name else "an event"
                    self.dropped_why = f"{name}: {got}"
                self.dropped += 1
            else:
                out.append(got)
        return out

    dropped = 0  # events left out: a field they need has a value of the wrong type (_coerce)
    dropped_why = ""

    def _finish(self, after: bytes) -> None:
        """Decode what follows the array: the rest of the top-level object (traceName, ...)."""
        tail = (bytes(after) + (self.reader.rest() if self.reader else b"")).strip(_WS)
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
