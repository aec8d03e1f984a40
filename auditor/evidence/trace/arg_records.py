"""Operators' argument records (input shapes, dtypes, strides, concrete inputs), read once during
the parse into a column of the trace's events and a table of distinct records.

Why: the profiler writes `Input Dims`, `Input type`, `Input Strides` and `Concrete Inputs` on every
operator when it records shapes. Rules and the efficiency model read them for many operators;
each reading the file again cost as much as the parse. So the decoder (auditor.evidence.trace.decode)
keeps, per operator row, the code of its record in an ArgTable (column `args`, -1: none), and the
loader decodes each distinct record once into an ArgRecord. A trace repeats the same few thousand
records (every step runs the same shapes), so the table stays small whatever the trace's length.

A record is read defensively: a dimension that is not a whole number in [0, MAX_DIM], or an input
whose dims are not a list of them, reads as "not a tensor" (dims None), never as a number a formula
then divides by; the readers skip such inputs and count them (see `readable`).
"""
from __future__ import annotations

from itertools import repeat
from typing import Any

import msgspec
import numpy as np

# A dimension or stride beyond this (2**48 elements) is not one a recorded tensor has: read as unusable.
MAX_DIM = 1 << 48

_NONE = msgspec.Raw(b"")


class RawOpArgs(msgspec.Struct, gc=False):
    """The argument fields of one operator event, left as raw JSON (decoded once per distinct record)."""

    dims: msgspec.Raw = msgspec.field(default=_NONE, name="Input Dims")
    types: msgspec.Raw = msgspec.field(default=_NONE, name="Input type")
    strides: msgspec.Raw = msgspec.field(default=_NONE, name="Input Strides")
    concrete: msgspec.Raw = msgspec.field(default=_NONE, name="Concrete Inputs")


RAW_DECODER = msgspec.json.Decoder(list[RawOpArgs])

# A record's key: its raw `Input Dims`, `Input type`, `Input Strides` and `Concrete Inputs` (b"" when
# absent) joined by NUL bytes, which valid JSON never holds (msgspec refuses it): one bytes object,
# hashed and compared once (four, and their tuple, cost ~2x as much on the 506 MB tiling's 0.6 M ops).
Key = bytes
_SEP = b"\0"
_NO_KEY = _SEP * 3


class ArgRecord(msgspec.Struct, frozen=True, gc=False):
    """One operator call's inputs as recorded: per input its dims (a list of ints, or None when the
    input is not a tensor or its dims cannot be read), its type as the profiler names it
    (`float`, `c10::BFloat16`, `Scalar`...; "" when absent), its strides (as dims) and its concrete
    value as text ("" when absent). The lists are as long as the longest the event records."""

    dims: tuple[tuple[int, ...] | None, ...] = ()
    types: tuple[str, ...] = ()
    strides: tuple[tuple[int, ...] | None, ...] = ()
    concrete: tuple[str, ...] = ()
    # per input, the shapes of a tensor list (an RNN's weights, `TensorList`), None for any other
    # input; empty when the record holds no list
    lists: tuple[tuple[tuple[int, ...], ...] | None, ...] = ()
    # inputs whose recorded dims or strides were unusable (negative, huge, not numbers)
    odd: int = 0

    def tensors(self) -> list[tuple[tuple[int, ...], str]]:
        """(dims, type) of the inputs that are tensors with at least one dimension."""
        out = []
        for i, d in enumerate(self.dims):
            t = self.types[i] if i < len(self.types) else ""
            if d and t not in ("Scalar", "ScalarList"):
                out.append((d, t))
        return out


NO_RECORD = ArgRecord()


class ArgTable:
    """Distinct raw records, each stored once; an operator row holds its record's index."""

    def __init__(self) -> None:
        self.keys: list[Key] = []
        self.ids: dict[Key, int] = {}

    def intern_many(self, keys: list[Key]) -> np.ndarray:
        if not keys:
            return np.empty(0, dtype=np.int32)
        ids = self.ids
        codes = np.fromiter(map(ids.get, keys, repeat(-1)), dtype=np.int32, count=len(keys))
        miss = np.flatnonzero(codes < 0).tolist()
        for i in miss:
            k = keys[i]
            c = ids.get(k)
            if c is None:
                c = ids[k] = len(self.keys)
                self.keys.append(k)
            codes[i] = c
        return codes

    def __len__(self) -> int:
        return len(self.keys)


def raw_keys(raws: list[msgspec.Raw]) -> list[Key]:
    """The record key of each operator event's raw args (one decode for the batch)."""
    if not raws:
        return []
    try:
        decoded = RAW_DECODER.decode(b"[" + b",".join(raws) + b"]")
    except (msgspec.DecodeError, msgspec.ValidationError):  # (args of the wrong type: no record)
        return [_NO_KEY] * len(raws)
    join = _SEP.join
    return [join((a.dims, a.types, a.strides, a.concrete)) for a in decoded]


def _json(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None


def _shape(v: Any) -> tuple[tuple[int, ...] | None, bool]:
    """(the dims, whether they were odd): a list of ints in [0, MAX_DIM] reads as a shape; an empty
    list as a 0-d tensor's; anything else as no tensor, odd when it was a list (of bad numbers)."""
    if not isinstance(v, list):
        return None, False
    if all(type(x) is int and 0 <= x <= MAX_DIM for x in v):
        return tuple(v), False
    return None, True


def _shapes(v: Any) -> tuple[tuple[int, ...], ...] | None:
    """A tensor list's dims (a list of shapes, each read as _shape reads one), None when any is not one."""
    if not isinstance(v, list) or not v:
        return None
    out = []
    for d in v:
        shape, _ = _shape(d)
        if shape is None:
            return None
        out.append(shape)
    return tuple(out)


def _text(v: Any) -> str:
    if isinstance(v, str):
        return v
    return "" if v is None else msgspec.json.encode(v).decode(errors="replace")


def record(key: Key) -> ArgRecord:
    """The typed record of a raw key (see ArgRecord); NO_RECORD when it records no inputs."""
    if key == _NO_KEY:
        return NO_RECORD
    dims_raw, types_raw, strides_raw, concrete_raw = (_json(k) for k in key.split(_SEP))
    dims, strides, lists, odd = [], [], [], 0
    for d in dims_raw if isinstance(dims_raw, list) else ():
        shape, bad = _shape(d)
        listed = _shapes(d) if bad else None
        dims.append(shape)
        lists.append(listed)
        odd += bad and listed is None
    for s in strides_raw if isinstance(strides_raw, list) else ():
        shape, bad = _shape(s)
        strides.append(shape)
        odd += bad
    types = tuple(_text(t) for t in types_raw) if isinstance(types_raw, list) else ()
    concrete = tuple(_text(c) for c in concrete_raw) if isinstance(concrete_raw, list) else ()
    return ArgRecord(dims=tuple(dims), types=types, strides=tuple(strides), concrete=concrete, odd=odd,
                     lists=tuple(lists) if any(x is not None for x in lists) else ())


def records(table: ArgTable) -> list[ArgRecord]:
    """Every record of the table, typed, in code order."""
    return [record(k) for k in table.keys]
