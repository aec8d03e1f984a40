"""A trace's events as numpy columns, built chunk by chunk from the Structs the stream decodes
(auditor.evidence.trace.decode): names interned as ints in a symbol table, pids and tids as ints,
categories in one vocabulary, the few `args` fields rules read, operators' argument records.

The rule the per-event work follows: an event is read once for its identity, the tuple (phase,
category, name, pid, tid), which one C-level dict lookup maps to a key code; everything that follows
from the identity (phase kind, category, name code, pid, tid) is computed once per distinct key (a
trace repeats a few thousand of them millions of times) and read for every event from per-key
tables with numpy. Times are read in one more pass each; `args` only for the rows a column needs.
"""
from __future__ import annotations

import operator
import zlib
from collections.abc import Callable
from itertools import compress, repeat
from typing import Any

import numpy as np

from auditor.evidence.trace.arg_records import ArgTable, raw_keys
from auditor.evidence.trace.decode import (_PHASE_KIND, _RAW_CATEGORY, CAT, GPU_SIDE, LAUNCH_SIDE, MAX_DUR_US,
                                           SymbolTable, _decode_args, _Event)
from auditor.evidence.trace.op_names import RECORDED_OPS

_INT64 = (-(1 << 63), 1 << 63)
_UNINTERNED = -2  # a key's symbols not interned yet (its events were not added yet)
# What of `args` an event row's columns read, by its key (_Keys.flags): a launch's or a GPU record's
# ids, a GPU record's bytes, stream and device, a `[memory]` event's bytes and totals, the old
# schema's Operator's call stack, a sync's kind, an operator's argument record (RECORDED_OPS).
_ARG_LAUNCH, _ARG_GPU, _ARG_MEMORY, _ARG_OPERATOR, _ARG_SYNC, _ARG_RECORD = 1, 2, 4, 8, 16, 32
_LAUNCH_CATS = frozenset(LAUNCH_SIDE)
_GPU_CATS = frozenset(GPU_SIDE + (CAT["gpu_annotation"],))


def _usable_times(ts: np.ndarray, dur: np.ndarray, complete: np.ndarray, flow_ts: np.ndarray) -> bool:
    """Whether _Stream._timed would leave none of a chunk's rows out: every event row and flow has a
    finite time, every complete event a duration in [0, MAX_DUR_US]."""
    if not (np.isfinite(ts).all() and np.isfinite(flow_ts).all()):
        return False
    if ((dur >= 0) & (dur <= MAX_DUR_US)).all():
        return True
    lasting = dur[complete]
    return bool(((lasting >= 0) & (lasting <= MAX_DUR_US)).all())


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


class _Keys:
    """The distinct identities (ph, cat, name, pid, tid) of the events read so far, each with a code,
    and per code what the columns read of it (numpy tables, grown as keys are learnt): the phase's
    kind, whether it starts a flow, the pid and tid as ints; the symbol codes of its category and
    name and its category in the one vocabulary once its events are added (Columns._learn)."""

    def __init__(self) -> None:
        self.codes: dict[tuple, int] = {}
        self.keys: list[tuple] = []
        self.kind = np.empty(0, dtype=np.int8)
        self.start = np.empty(0, dtype=bool)
        self.pid = np.empty(0, dtype=np.int64)
        self.tid = np.empty(0, dtype=np.int64)
        self.raw_cat = np.empty(0, dtype=np.int32)
        self.name = np.empty(0, dtype=np.int32)
        self.cat = np.empty(0, dtype=np.int8)
        self.flags = np.empty(0, dtype=np.uint8)  # which `args` fields its rows read (_ARG_* bits)

    def lookup(self, keys: list[tuple], norm_id: Callable[[int | str], int]) -> np.ndarray:
        """The code of each key, learning new ones (the Python loop runs over unseen keys only)."""
        codes = np.fromiter(map(self.codes.get, keys, repeat(-1)), dtype=np.int32, count=len(keys))
        miss = np.flatnonzero(codes < 0).tolist()
        if miss:
            unseen = list(map(keys.__getitem__, miss))
            new = list(dict.fromkeys(unseen))  # distinct, in order of first appearance
            self.codes.update(zip(new, range(len(self.keys), len(self.keys) + len(new))))
            self.keys.extend(new)
            grow = len(new)
            self.kind = np.concatenate([self.kind, np.fromiter((_PHASE_KIND.get(k[0], 0) for k in new), np.int8, grow)])
            self.start = np.concatenate([self.start, np.fromiter((k[0] == "s" for k in new), bool, grow)])
            self.pid = np.concatenate([self.pid, np.fromiter((_in_int64(norm_id(k[3])) for k in new), np.int64, grow)])
            self.tid = np.concatenate([self.tid, np.fromiter((_in_int64(norm_id(k[4])) for k in new), np.int64, grow)])
            self.raw_cat = np.concatenate([self.raw_cat, np.full(grow, _UNINTERNED, np.int32)])
            self.name = np.concatenate([self.name, np.full(grow, _UNINTERNED, np.int32)])
            self.cat = np.concatenate([self.cat, np.zeros(grow, np.int8)])
            self.flags = np.concatenate([self.flags, np.zeros(grow, np.uint8)])
            codes[miss] = np.fromiter(map(self.codes.__getitem__, unseen), dtype=np.int32, count=len(miss))
        return codes


def _in_int64(v: int) -> int:
    return v if _INT64[0] <= v < _INT64[1] else -1


def _arg_flags(cat: int, key: tuple, instant: bool) -> int:
    """The _ARG_* bits of an event row of category `cat` (the one vocabulary) and key (ph, cat, name, ...)."""
    return ((_ARG_LAUNCH if cat in _LAUNCH_CATS else 0) | (_ARG_GPU if cat in _GPU_CATS else 0)
            | (_ARG_MEMORY if cat == CAT["memory"] else 0)
            # (the old schema's "Operator" events carry the Python stack as a `Call stack` argument)
            | (_ARG_OPERATOR if key[1].lower() == "operator" else 0)
            | (_ARG_SYNC if cat == CAT["sync"] else 0)
            | (_ARG_RECORD if cat == CAT["cpu_op"] and not instant and key[2] in RECORDED_OPS else 0))


def _first_seen(codes: np.ndarray) -> np.ndarray:
    """The distinct codes, in order of first appearance."""
    distinct, first = np.unique(codes, return_index=True)
    return distinct[np.argsort(first, kind="stable")]


class Columns:
    """Accumulates per-chunk numpy columns (`parts`, `flow_parts`) and the metadata events (`meta`)."""

    def __init__(self, symbols: SymbolTable, args: ArgTable | None = None):
        self.symbols = symbols
        self.args = ArgTable() if args is None else args  # operators' argument records (column `args`)
        self.parts: dict[str, list[np.ndarray]] = {}
        self.flow_parts: dict[str, list[np.ndarray]] = {}
        self.meta: list[_Event] = []
        self._ids: dict[str, int] = {}  # non-numeric pid/tid strings -> negative ids
        self._keys = _Keys()

    def _norm_id(self, v: int | str) -> int:
        """A pid, tid or flow id as an int: an int as it is, a number spelt as text ("25738", "+5")
        as int() reads it, "stream 7" as 7, a label ("Spans") as a stable negative id, the same
        however the file was chunked."""
        if type(v) is int:
            return v
        got = self._ids.get(v)  # type: ignore[arg-type]
        if got is None:
            s = str(v).strip()
            try:
                got = int(s) if len(s) <= 20 else None  # (longer than any int64: a label, however it reads)
            except ValueError:
                got = int(s[7:]) if s.startswith("stream ") and s[7:].strip().isdigit() else None
            if got is None:
                got = -1000 - (zlib.crc32(s.encode()) & 0x3FFFFFFF)
            self._ids[v] = got  # type: ignore[index]
        return got

    def _learn(self, codes: np.ndarray, names: bool) -> None:
        """Intern the category (and, for event rows, the name) of the keys among `codes` whose
        symbols are not interned yet: categories first, then names, each in order of first
        appearance, so that symbol codes are numbered as the events read them. For event rows, the
        category in the one vocabulary too (an instant `[memory]` event is `memory`, another
        instant of no known category `instant`)."""
        keys = self._keys
        pending = keys.raw_cat[codes] == _UNINTERNED
        if not pending.any():  # (every chunk after a trace's first few)
            return
        new = _first_seen(codes[pending])
        rows = [keys.keys[c] for c in new.tolist()]
        keys.raw_cat[new] = self.symbols.intern_many([k[1] for k in rows])
        if not names:
            return
        keys.name[new] = self.symbols.intern_many([k[2] for k in rows])
        cats = np.fromiter((CAT.get(_RAW_CATEGORY.get(k[1].lower(), "other"), 0) for k in rows), np.int8, len(rows))
        instant = keys.kind[new] == 4
        memory = np.fromiter((k[2] == "[memory]" for k in rows), bool, len(rows))
        cats[instant & memory] = CAT["memory"]
        cats[instant & ~memory & (cats == 0)] = CAT["instant"]
        keys.cat[new] = cats
        keys.flags[new] = [_arg_flags(c, k, i) for c, k, i in zip(cats.tolist(), rows, instant.tolist())]

    def add(self, events: list[_Event], timed: Callable[[list[_Event]], list[_Event]] | None = None) -> None:
        """Append a chunk's columns. `timed`: given for events whose times were not checked
        (_Stream.chunks(timed=False)); when a row's time cannot be used (none, an infinite one, a
        duration no event has), the chunk is added as `timed` leaves it (_Stream._timed, which
        counts what it leaves out). The check reads the time columns made here anyway: a second
        pass over every event's times cost ~5% of the parse."""
        # Fields are read with list comprehensions (the interpreter's specialised attribute loads
        # beat map(attrgetter)); rows are picked by index, never through numpy object arrays, whose
        # element-wise fill costs ~150 ns an event.
        codes = self._keys.lookup([(e.ph, e.cat, e.name, e.pid, e.tid) for e in events], self._norm_id)
        kind = self._keys.kind[codes]
        ts = np.fromiter([e.ts for e in events], dtype=np.float64, count=len(events))
        dur = np.fromiter([e.dur for e in events], dtype=np.float64, count=len(events))
        body = np.flatnonzero((kind == 1) | (kind == 4))
        flows = np.flatnonzero(kind == 2)
        whole = len(body) == len(events)
        if whole:
            body_ts, body_dur = ts, dur
        else:
            body_ts, body_dur = ts[body], dur[body]
        if timed is not None and not _usable_times(body_ts, body_dur, kind[body] == 1, ts[flows]):
            self.add(timed(events))
            return
        if not whole and (kind == 3).any():
            self.meta.extend(compress(events, (kind == 3).tolist()))
        if len(flows):
            self._add_flows(events, flows, codes[flows], ts[flows])
        if len(body):
            self._add_rows(events, body if not whole else None, codes[body] if not whole else codes, body_ts, body_dur)

    def _add_flows(self, events: list[_Event], rows: np.ndarray, codes: np.ndarray, ts: np.ndarray) -> None:
        """The flow events' columns (ac2g links, fwdbwd...): their id, start or end, thread, time, category."""
        self._learn(codes, names=False)
        keys, put, norm = self._keys, self.flow_parts, self._norm_id
        ids = [-1 if e.id is None else (e.id if type(e.id) is int else norm(e.id))
               for e in map(events.__getitem__, rows.tolist())]
        self._put(put, "id", _int_column(ids))
        self._put(put, "start", keys.start[codes])
        self._put(put, "pid", keys.pid[codes])
        self._put(put, "tid", keys.tid[codes])
        self._put(put, "ts", ts)
        self._put(put, "cat", keys.raw_cat[codes])

    def _add_rows(self, events: list[_Event], rows: np.ndarray | None, codes: np.ndarray, ts: np.ndarray,
                  dur: np.ndarray) -> None:
        """The event rows' columns (`rows` of `events`; None: all of them)."""
        self._learn(codes, names=True)
        keys, put = self._keys, self.parts
        cats = keys.cat[codes]
        raw_cat = keys.raw_cat[codes]
        name_codes = keys.name[codes]
        instant = keys.kind[codes] == 4
        self._put(put, "cat", cats)
        self._put(put, "raw_cat", raw_cat)
        self._put(put, "name", name_codes)
        self._put(put, "instant", instant)
        self._put(put, "pid", keys.pid[codes])
        self._put(put, "tid", keys.tid[codes])
        self._put(put, "ts", ts)
        self._put(put, "dur", dur)
        self._add_args(events, rows, keys.flags[codes])

    def _add_args(self, events: list[_Event], rows: np.ndarray | None, flags: np.ndarray) -> None:
        """The columns read from `args` (`flags`: each row's _ARG_* bits), decoded only for the rows
        some column reads, in one batch; operators' argument records."""
        n, put = len(flags), self.parts
        need = np.flatnonzero(flags & (_ARG_LAUNCH | _ARG_GPU | _ARG_MEMORY | _ARG_OPERATOR))
        at = need if rows is None else rows[need]
        args = _decode_args([events[i].args for i in at.tolist()])
        reads = flags[need]

        def column(bits: int, *attrs: str) -> list[np.ndarray]:
            """The int64 columns of `attrs` (-1 where absent) on the rows with any of `bits`."""
            out = [np.full(n, -1, dtype=np.int64) for _ in attrs]
            pick = np.flatnonzero(reads & bits)
            if len(pick):
                sub = args if len(pick) == len(args) else [args[i] for i in pick.tolist()]
                for col, attr in zip(out, attrs):
                    col[need[pick]] = _arg_column(sub, attr)
            return out

        ext, ext_old, correlation = column(_ARG_LAUNCH | _ARG_GPU, "external_id", "external_id_old", "correlation")
        gpu_bytes, stream, device = column(_ARG_GPU, "bytes", "stream", "device")
        mem_bytes, total, device_type = column(_ARG_MEMORY, "mem_bytes", "total_allocated", "device_type")
        self._put(put, "external_id", np.maximum(ext, ext_old))
        self._put(put, "correlation", correlation)
        # (a `[memory]` event's Bytes is negative for a free: not a maximum with the absent -1)
        self._put(put, "bytes", np.where(flags & _ARG_MEMORY, mem_bytes, gpu_bytes))
        self._put(put, "stream", stream)
        self._put(put, "device", device)
        self._put(put, "total_allocated", total)
        self._put(put, "device_type", device_type)
        self._put(put, "stack", self._subset_symbols(args, need, reads, _ARG_OPERATOR, "call_stack", n))
        self._put(put, "sync_kind", self._subset_symbols(args, need, reads, _ARG_SYNC, "sync_kind", n))
        # The argument records (shapes, dtypes, strides, concrete inputs) of the operators rules and the
        # efficiency model read (RECORDED_OPS), read here once (auditor.evidence.trace.arg_records).
        records = np.full(n, -1, dtype=np.int32)
        op_rows = np.flatnonzero(flags & _ARG_RECORD)
        if len(op_rows):
            at = op_rows if rows is None else rows[op_rows]
            records[op_rows] = self.args.intern_many(raw_keys([events[i].args for i in at.tolist()]))
        self._put(put, "args", records)

    def _subset_symbols(self, args: list[Any], need: np.ndarray, reads: np.ndarray, bit: int, attr: str,
                        n: int) -> np.ndarray:
        """A string args field as symbol codes on the rows with `bit` (args decoded for rows `need`)."""
        out = np.full(n, -1, dtype=np.int32)
        pick = np.flatnonzero(reads & bit)
        if len(pick):
            values = [getattr(args[i], attr) for i in pick.tolist()]
            if any(v is not None for v in values):
                out[need[pick]] = self.symbols.intern_many(values)
        return out

    @staticmethod
    def _put(store: dict[str, list[np.ndarray]], key: str, arr: np.ndarray) -> None:
        store.setdefault(key, []).append(arr)

