"""Kernel efficiency from a trace that records shapes (`record_shapes=True`): FLOPs and bytes per
operator, achieved TFLOP/s and TB/s per operator and per kernel group, roofline position, and per
step the GPU's busy, idle and communication time and the model FLOP utilisation (MFU), judged by the
device model's row (auditor.evidence.devices). Each distinct (operator, shape record) is worked out
once (the formulas: `_op_work` and the helpers it calls); one the formulas cannot read is left out and
counted (Efficiency.unread_ops), never fatal. A GPU kernel is charged to the innermost operator that
launched it (kernel -> its launch by correlation -> the enclosing operator).
"""
from __future__ import annotations

import ast
import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from auditor.evidence.devices import DeviceSpec, device_for
from auditor.evidence.errors import InputError
from auditor.evidence.trace.arg_records import MAX_DIM, ArgRecord
from auditor.evidence.trace.decode import CAT, DEFAULT_CHUNK_BYTES, GPU_WORK, _Stream
from auditor.evidence.trace.intervals import clip, intersect, merge_intervals, subtract, total_length
from auditor.evidence.trace.model import Trace
from auditor.evidence.trace.names import COMM_KERNEL
from auditor.evidence.trace.op_names import _ATTENTION, _CONV, _ELEMENTWISE, _MATMUL, _NORM, _RNN, _SOFTMAX, MODELLED

# Kernel groups, by kernel name, first match wins (communication first: an NCCL kernel is never
# compute, whatever else its name holds). rccl is ROCm's NCCL; Cijk_ names are rocBLAS/Tensile GEMMs.
KERNEL_GROUPS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("communication", COMM_KERNEL),
    ("attention", re.compile(r"flash|fmha|attention|attn", re.IGNORECASE)),
    ("softmax", re.compile(r"softmax", re.IGNORECASE)),
    ("norm", re.compile(r"norm|bn_fw|bn_bw|welford", re.IGNORECASE)),
    ("gemm", re.compile(r"gemm|gemv|cutlass|xmma|matmul|cublas|Cijk_", re.IGNORECASE)),
    ("conv", re.compile(r"conv|cudnn|implicit|winograd|wgrad|dgrad|fprop|miopen", re.IGNORECASE)),
    ("reduce", re.compile(r"reduce", re.IGNORECASE)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise|triton|index|fill|copy|cat",
                               re.IGNORECASE)),
)
COMMUNICATION = COMM_KERNEL  # (names.is_comm_kernel's pattern: one predicate for every rule)


_ELEMENT_BYTES = {"float": 4, "c10::half": 2, "c10::bfloat16": 2, "double": 8, "long int": 8, "int": 4,
                  "short int": 2, "bool": 1, "signed char": 1, "unsigned char": 1, "c10::complex<float>": 8}
_DTYPE = {"float": "float32", "c10::half": "float16", "c10::bfloat16": "bfloat16", "double": "float64"}


class OpStat(msgspec.Struct, frozen=True):
    """One operator and shape as the GPU ran it: `op` (aten name), `kind` (matmul | conv |
    attention | softmax | norm | elementwise), `shapes` (its input dims as recorded), `dtype`
    (float32 | bfloat16 | ...), `count` (calls), `kernel_ms` (its kernels' time, all calls),
    `flops` and `bytes` (all calls), `tflops` and `tbps` (achieved: flops and bytes over kernel
    time; None without kernel time), `intensity` (FLOP per byte), `peak_share` (achieved over the
    device's peak for its bound: compute above the ridge point, bandwidth below; None without a
    device), `bound` (compute | memory | None)."""

    op: str
    kind: str
    shapes: str
    dtype: str
    count: int
    kernel_ms: float
    flops: float
    bytes: float
    tflops: float | None
    tbps: float | None
    intensity: float | None
    peak_share: float | None
    bound: str | None


class GroupStat(msgspec.Struct, frozen=True):
    """One kernel group (KERNEL_GROUPS, plus memcpy, memset and other): `kernels` (count), `ms`
    (their time, summed), `share` (of all GPU work time), `flops` (of the modelled operators whose
    kernels are in it), `tflops` (achieved over the group's time, None without FLOPs)."""

    group: str
    kernels: int
    ms: float
    share: float
    flops: float
    tflops: float | None


class StepGpu(msgspec.Struct, frozen=True):
    """The GPU in one step (findings.json `steps.gpu[]`): `step` (ProfilerStep number; None when
    the trace is one window), `device` (the device model's row key; None when unknown),
    `busy_ms` (union of kernels, copies and memsets inside the step's span), `idle_ms` (the rest of
    the span), `comm_ms` (union of communication kernels), `exposed_comm_ms` (communication not
    overlapped by any other kernel), `flops` (of the modelled operators whose first kernel ran in
    the step; None when the trace records no shapes), `achieved_tflops` (flops over the step's
    span), `mfu` (achieved over the device's peak for the dtype that carries most of the FLOPs;
    None without a device or FLOPs)."""

    step: int | None
    device: str | None
    busy_ms: float
    idle_ms: float
    comm_ms: float
    exposed_comm_ms: float
    flops: float | None
    achieved_tflops: float | None
    mfu: float | None


class Efficiency(msgspec.Struct, frozen=True):
    """What efficiency() found in one trace: the device row and where it came from, whether shapes
    were recorded, operators (by kernel time, largest first), kernel groups, and steps."""

    device: DeviceSpec | None
    device_basis: str
    has_shapes: bool
    ops: list[OpStat]
    groups: list[GroupStat]
    steps: list[StepGpu]
    gpu_ms: float  # all GPU work (kernels, copies, memsets), summed
    # modelled operator calls with kernels whose recorded inputs the formulas could not use (left out)
    unread_ops: int = 0
    # why the model could not read the trace at all ("" when it could): the tables are empty then
    failed: str = ""


# -- shapes ------------------------------------------------------------------------------------
def _compat(rec: ArgRecord) -> tuple[list, list, list]:
    """A record as (input dims, input types, concrete inputs) lists, an input that is not a
    readable tensor as [] (what op_shapes' readers expect); a tensor list as the list of its shapes."""
    lists = rec.lists
    return ([list(d) if d is not None else
             [list(x) for x in lists[i]] if i < len(lists) and lists[i] is not None else []
             for i, d in enumerate(rec.dims)], list(rec.types), list(rec.concrete))


def op_rows(trace: Trace, names: Any) -> np.ndarray:
    """Rows of the operators named in `names` (not instants) that carry an argument record with
    input dims (read during the parse: auditor.evidence.trace.arg_records)."""
    if "args" not in trace.events:
        return np.empty(0, dtype=np.int64)
    codes = [c for c in (trace.symbols.id(n) for n in names) if c >= 0]
    if not codes:
        return np.empty(0, dtype=np.int64)
    args = trace.col("args")
    rows = np.flatnonzero((args >= 0) & np.isin(trace.col("name"), codes) & (trace.col("cat") == CAT["cpu_op"])
                          & ~trace.col("instant"))
    with_dims = np.fromiter((bool(r.dims) for r in trace.arg_records), dtype=bool, count=len(trace.arg_records))
    return rows[with_dims[args[rows]]] if len(rows) else rows


def op_shapes(trace: Trace) -> dict[int, tuple[list, list, list]]:
    """{row: (input dims, input types, concrete inputs)} of the modelled operators (MODELLED) the
    trace records shapes for; empty when it records none. Taken from the argument records the
    parse read (the trace's `args` column); each distinct record is converted once."""
    cached = trace.__dict__.get("_op_shapes")
    if cached is not None:
        return cached
    rows = op_rows(trace, MODELLED)
    args = trace.col("args") if len(rows) else np.empty(0, dtype=np.int32)
    compat: dict[int, tuple[list, list, list]] = {}
    out: dict[int, tuple[list, list, list]] = {}
    for r, c in zip(rows.tolist(), args[rows].tolist()):
        got = compat.get(c)
        if got is None:
            got = compat[c] = _compat(trace.arg_records[c])
        out[r] = got
    trace.__dict__["_op_shapes"] = out
    return out


class CommArgs(msgspec.Struct):
    """What the profiler records on a communication kernel (torch >= 2.1 with NCCL): the collective
    (`allreduce`...), its element count in and out, the element type and the group's size."""

    collective: Any = msgspec.field(default=None, name="Collective name")
    in_nelems: Any = msgspec.field(default=None, name="In msg nelems")
    out_nelems: Any = msgspec.field(default=None, name="Out msg nelems")
    dtype: Any = None
    group_size: Any = msgspec.field(default=None, name="Group size")


_COMM_ARGS = msgspec.json.Decoder(list[CommArgs])


def comm_args(trace: Trace) -> dict[int, CommArgs]:
    """{row: CommArgs} of the communication kernels that record their collective."""
    cached = trace.__dict__.get("_comm_args")
    if cached is not None:
        return cached
    codes = trace.symbols.matching(COMMUNICATION)
    rows = np.flatnonzero((trace.col("cat") == CAT["kernel"]) & np.isin(trace.col("name"), codes)) \
        if len(codes) else np.empty(0, dtype=np.int64)
    out: dict[int, CommArgs] = {}
    if len(rows):
        found = _read_args(trace, lambda name: COMMUNICATION.search(name) is not None, b"Collective name",
                           _COMM_ARGS)
        out = _join(trace, rows, found)
    trace.__dict__["_comm_args"] = out
    return out


def _read_args(trace: Trace, wanted_name: Any, marker: bytes, decoder: Any) -> dict[tuple[str, float], Any]:
    """{(name, ts): decoded args} of the events whose name `wanted_name` accepts and whose args
    hold `marker`. The file is streamed chunk by chunk as the loader does (never held whole), and
    only those events' args are decoded; empty when the file cannot be read again here."""
    found: dict[tuple[str, float], Any] = {}
    stream = None
    try:
        stream = _Stream(Path(trace.path), DEFAULT_CHUNK_BYTES)
        stream.start()
        for events in stream.chunks():
            wanted = [e for e in events if isinstance(e.name, str) and wanted_name(e.name)
                      and marker in bytes(e.args)]
            if wanted:
                decoded = decoder.decode(b"[" + b",".join(bytes(e.args) for e in wanted) + b"]")
                for e, a in zip(wanted, decoded):
                    found[(e.name, float(e.ts))] = a
    except (InputError, OSError, msgspec.DecodeError, msgspec.ValidationError):
        return {}
    finally:
        if stream is not None and stream.reader is not None:
            stream.reader.close()
    return found


def _join(trace: Trace, rows: np.ndarray, found: dict[tuple[str, float], Any]) -> dict[int, Any]:
    """Trace rows matched to what _read_args found, by name and start time."""
    ts, names = trace.col("ts"), trace.col("name")
    out = {}
    for r in rows.tolist():
        hit = found.get((trace.symbols[int(names[r])], float(ts[r])))
        if hit is not None:
            out[r] = hit
    return out


# -- formulas ----------------------------------------------------------------------------------
def _is_shape(shape: Any) -> bool:
    """A list of dimensions a tensor can have: whole numbers in [0, MAX_DIM]."""
    return isinstance(shape, (list, tuple)) and all(type(d) is int and 0 <= d <= MAX_DIM for d in shape)


def _numel(shape: Any) -> int:
    if not _is_shape(shape):
        return 0
    return math.prod(shape) if shape else 0


def _elt(dtype: Any) -> int:
    return _ELEMENT_BYTES.get(str(dtype).lower(), 4) if dtype else 4


def op_kind(name: str) -> str | None:
    for kind, names in (("matmul", _MATMUL), ("conv", _CONV), ("attention", _ATTENTION), ("rnn", _RNN),
                        ("softmax", _SOFTMAX),
                        ("norm", _NORM), ("elementwise", _ELEMENTWISE)):
        if name in names:
            return kind
    return None


def _tensors(dims: Any, types: Any) -> list[tuple[list[int], str]]:
    """(dims, type) of the inputs that are tensors of readable shape (see _is_shape)."""
    if not isinstance(dims, (list, tuple)):
        return []
    types = types if isinstance(types, (list, tuple)) else []
    out = []
    for i, d in enumerate(dims):
        t = types[i] if i < len(types) else ""
        if d and _is_shape(d) and t not in ("Scalar", "ScalarList"):
            out.append((list(d), str(t)))
    return out


def _ints(text: Any) -> list[int] | None:
    try:
        v = ast.literal_eval(text) if isinstance(text, str) and text else None
    except (ValueError, SyntaxError):
        return None
    if isinstance(v, int):
        return [v]
    return list(v) if isinstance(v, (list, tuple)) and all(isinstance(x, int) for x in v) else None


_TRANSPOSABLE = frozenset(("aten::convolution", "aten::_convolution", "aten::convolution_backward"))


def op_work(name: str, dims: Any, types: Any, concrete: Any = None) -> tuple[float, float, str] | None:
    """(FLOPs, bytes, dtype) of one call of operator `name` with these recorded inputs, or None
    when its shapes do not fit the formula (`_op_work`) or cannot be read (a stride of 0 or
    below, a dimension that is negative, huge or not a number, an input missing): the caller skips
    the call and counts it."""
    try:
        got = _op_work(name, dims, types, concrete if isinstance(concrete, (list, tuple)) else None)
    except (ArithmeticError, ValueError, TypeError, IndexError):
        return None
    if got is None or not all(math.isfinite(x) and x >= 0 for x in got[:2]):
        return None
    return got


def _op_work(name: str, dims: Any, types: Any, concrete: Any) -> tuple[float, float, str] | None:
    """One multiply-add is 2 FLOPs; the bytes are every input and the output read or written once.
    Softmax and norms 5 FLOPs an element, elementwise ops 1 an output element; the rest by kind."""
    kind = op_kind(name)
    ts = _tensors(dims, types)
    if kind is None or not ts:
        return None
    dtype_raw = ts[0][1]
    dtype = _DTYPE.get(dtype_raw.lower(), dtype_raw.lower() or "float32")
    if "float8" in dtype:
        dtype = "fp8"
    elt = _elt(dtype_raw)
    in_bytes = sum(_numel(d) * _elt(t) for d, t in ts)
    if kind == "matmul":
        return _matmul_work(name, ts, in_bytes, elt, dtype)
    if kind == "conv":
        return _conv_work(name, ts, concrete, in_bytes, elt, dtype)
    if kind == "attention":
        return _attention_work(name, ts, in_bytes, elt, dtype)
    if kind == "rnn":
        return _rnn_work(name, dims, ts, elt, dtype)
    numel = max(_numel(d) for d, _ in ts)
    if kind in ("softmax", "norm"):
        return 5.0 * numel, float(in_bytes + numel * elt), dtype
    return float(numel), float(in_bytes + numel * elt), dtype


def _matmul_work(name: str, ts: list, in_bytes: int, elt: int, dtype: str) -> tuple[float, float, str] | None:
    """A matrix product's (FLOPs, bytes, dtype) (mm, addmm, bmm, baddbmm, linear): 2*M*N*K per batch."""
    mats = [d for d, _ in ts if len(d) >= 2]
    if name in ("aten::addmm", "aten::baddbmm", "aten::_addmm_activation"):
        mats = mats[-2:] if len(mats) >= 2 else mats
    if name == "aten::linear":
        if len(mats) < 1 or len(ts[1][0]) != 2:
            return None
        x, w = ts[0][0], ts[1][0]
        m, k, n = _numel(x[:-1]), x[-1], w[0]
        batch = 1
    else:
        if len(mats) < 2:
            return None
        a, b = mats[0], mats[1]
        if a[-1] != b[-2]:
            return None
        m, k, n = a[-2], a[-1], b[-1]
        batch = max(_numel(a[:-2]) or 1, _numel(b[:-2]) or 1)
    flops = 2.0 * batch * m * n * k
    return flops, float(in_bytes + batch * m * n * elt), dtype


def _conv_work(name: str, ts: list, concrete: Any, in_bytes: int, elt: int,
               dtype: str) -> tuple[float, float, str] | None:
    """A convolution's (FLOPs, bytes, dtype): 2*N*O*H'*W'*(C/g)*kh*kw, the output's size from the
    stride in `Concrete Inputs` when recorded, else the input's; a transposed one 2*N*C*H*W*(O/g)*kh*kw
    (each input element into its outputs); a backward twice its forward."""
    backward = name.endswith("_backward")
    # a transposed convolution (ConvTranspose: aten::convolution's `transposed`, its 7th
    # argument, the 8th of its backward) multiplies every input element into the weight's
    # Cout/groups x kernel outputs; its weight is (Cin, Cout/groups, kernel...)
    flag = 7 if backward else 6
    transposed = (name in _TRANSPOSABLE and concrete is not None and len(concrete) > flag
                  and concrete[flag] == "True")
    if backward:  # grad_output, input, weight
        if len(ts) < 3:
            return None
        (go, _), (x, _), (w, _) = ts[0], ts[1], ts[2]
        if len(go) < 3 or len(w) < 3:
            return None
        flops = 2.0 * 2.0 * (_numel(x) if transposed else go[0] * go[1] * _numel(go[2:])) * _numel(w[1:])
        return flops, float(in_bytes + _numel(x) * elt + _numel(w) * elt), dtype
    if len(ts) < 2:
        return None
    (x, _), (w, _) = ts[0], ts[1]
    if len(x) < 3 or len(w) < 3:
        return None
    spatial = x[2:]
    stride = _ints(concrete[3]) if concrete and len(concrete) > 3 else None
    if stride:
        if any(st <= 0 or st > MAX_DIM for st in stride):  # (no convolution has one: the record is unreadable)
            return None
        stride = (stride * len(spatial))[:len(spatial)] if len(stride) == 1 else stride
    strided = stride is not None and len(stride) == len(spatial)
    if transposed:  # the output: the input upsampled by the stride (padding left out)
        groups = _ints(concrete[8]) if len(concrete) > 8 else None
        up = _numel(stride) if strided else 1
        out_elems = x[0] * w[1] * (groups[0] if groups else 1) * _numel(spatial) * up
        return 2.0 * _numel(x) * _numel(w[1:]), float(in_bytes + out_elems * elt), dtype
    if strided:
        spatial = [max(1, s // st) for s, st in zip(spatial, stride)]
    out_elems = x[0] * w[0] * _numel(spatial)
    flops = 2.0 * out_elems * _numel(w[1:])
    return flops, float(in_bytes + out_elems * elt), dtype


def _attention_work(name: str, ts: list, in_bytes: int, elt: int, dtype: str) -> tuple[float, float, str] | None:
    """Scaled dot-product attention's (FLOPs, bytes, dtype): 4*B*H*L*S*E forward (QK^T and PV),
    2.5 times that backward."""
    if len(ts) < 3:
        return None
    (q, _), (k, _), (v, _) = ts[0], ts[1], ts[2]
    if name.endswith("_backward"):  # grad_out, q, k, v, ...
        if len(ts) < 4:
            return None
        (q, _), (k, _), (v, _) = ts[1], ts[2], ts[3]
    if len(q) < 3 or len(k) < 3:
        return None
    heads = _numel(q[:-2])
    flops = 2.0 * heads * q[-2] * k[-2] * (q[-1] + v[-1])
    if name.endswith("_backward"):
        flops *= 2.5
    return flops, float(in_bytes + _numel(q[:-1]) * v[-1] * elt), dtype


def _rnn_work(name: str, dims: Any, ts: list, elt: int, dtype: str) -> tuple[float, float, str] | None:
    """A recurrent layer's (FLOPs, bytes, dtype): its 2-D weights each multiply every time step of
    every sequence (the input's rows, padded or packed); the bytes are the input and the weights
    read and an output as large as the input written (the states and biases left out); a backward
    twice its forward. cuDNN's _cudnn_rnn and MIOpen's miopen_rnn list every layer's weights, oneDNN's
    mkldnn_rnn_layer one layer's."""
    x = ts[0][0]
    if "mkldnn" in name:  # (input, w_ih, w_hh, b_ih, b_hh, hx, cx, ...): one layer and direction
        weights = [d for d in dims[1:3] if _is_shape(d) and len(d) == 2]
    else:  # (input, weight list, ...): the first tensor list of matrices
        weights = next(([s for s in d if _is_shape(s) and len(s) == 2] for d in dims
                        if isinstance(d, list) and d and isinstance(d[0], list)
                        and any(_is_shape(s) and len(s) == 2 for s in d)), [])
    if not weights or len(x) < 2:
        return None
    rows = _numel(x[:-1])
    n = sum(_numel(w) for w in weights)
    flops = 2.0 * rows * n * (2.0 if name.endswith("_backward") else 1.0)
    return flops, float((2 * _numel(x) + n) * elt), dtype


# -- kernels -> operators -------------------------------------------------------------------------
def kernel_group(name: str) -> str:
    for group, pattern in KERNEL_GROUPS:
        if pattern.search(name):
            return group
    return "other"


def kernel_ops(trace: Trace) -> np.ndarray:
    """For every row, the row of the modelled operator a GPU kernel is charged to (-1 for other
    rows and unattributed kernels): the innermost operator enclosing its launch when modelled; an
    attention operator up to three operators out (SDPA runs its kernels under private ops)."""
    cached = trace.__dict__.get("_kernel_ops")
    if cached is not None:
        return cached
    cat, link, parent, names = trace.col("cat"), trace.col("link"), trace.col("parent"), trace.col("name")
    out = np.full(len(cat), -1, dtype=np.int64)
    # per name code: 1 a modelled attention operator, 0 another modelled operator, -1 not modelled
    kind_of = np.full(len(trace.symbols), -1, dtype=np.int8)
    for c in {trace.symbols.id(n) for n in MODELLED} - {-1}:
        kind_of[c] = 1 if op_kind(trace.symbols[c]) == "attention" else 0
    kernels = np.flatnonzero((cat == CAT["kernel"]) & (link >= 0))
    starts, which = np.unique(parent[link[kernels]], return_inverse=True)
    # every launch's ancestors walked together: the operators met are counted (level); the first
    # modelled one is kept and ends the walk unless it is attention, an attention up to the fourth
    # replaces what was kept
    found = np.full(len(starts), -1, dtype=np.int64)
    r, level = starts.astype(np.int64), np.zeros(len(starts), dtype=np.int64)
    live = np.flatnonzero(r >= 0)
    while len(live):
        at = r[live]
        op = cat[at] == CAT["cpu_op"]
        kind = np.where(op & (names[at] >= 0), kind_of[names[at]], -1)
        hit = (kind >= 0) & ((level[live] == 0) | (kind == 1))
        found[live[hit]] = at[hit]
        done = hit & (level[live] == 0) & (kind == 0)
        level[live[op]] += 1
        r[live] = parent[at]
        live = live[~done & (r[live] >= 0) & (level[live] < 4)]
    out[kernels] = found[which.reshape(-1)]
    trace.__dict__["_kernel_ops"] = out
    return out


# -- the summary -------------------------------------------------------------------------------
def efficiency(trace: Trace, chosen: str = "") -> Efficiency:
    """The trace's efficiency (cached per trace and `chosen`, the `--device` key). Never raises:
    a trace the model cannot read gives an empty table whose `failed` says why, and the reports
    (findings.json, report.html) are written without it."""
    cache: dict[str, Efficiency] = trace.__dict__.setdefault("_efficiency", {})
    if chosen not in cache:
        try:
            cache[chosen] = _efficiency(trace, chosen)
        except Exception as e:  # noqa: BLE001 (one odd record must not cost the user the report)
            cache[chosen] = Efficiency(device=None, device_basis="", has_shapes=False, ops=[], groups=[], steps=[],
                                       gpu_ms=0.0, failed=f"{type(e).__name__}: {e}")
    return cache[chosen]


def reported_efficiency(evidence: Any) -> Efficiency | None:
    """The efficiency the reports read (of gpu_trace(), for the run's device), made now (None
    when no trace shows GPU work)."""
    trace = gpu_trace(evidence)
    return efficiency(trace, evidence.environment.device_model) if trace is not None else None


def keep_reported_efficiency(evidence: Any, made: Efficiency | None) -> None:
    """Keep `made`, reported_efficiency() as made in a fork of this process (None: nothing), as
    that trace's efficiency here, unless this process made it itself."""
    trace = gpu_trace(evidence) if isinstance(made, Efficiency) else None
    if trace is not None:
        trace.__dict__.setdefault("_efficiency", {}).setdefault(evidence.environment.device_model, made)


def _gpu_device(trace: Trace) -> int | None:
    dev = trace.col("device")[trace.col("cat") == CAT["kernel"]]
    dev = dev[dev >= 0]
    return int(np.bincount(dev).argmax()) if len(dev) else None


def trace_device(trace: Trace, chosen: str = "") -> DeviceSpec | None:
    """The device the trace's kernels ran on, as the efficiency model takes it (`chosen`: the
    `--device` key), without the model's tables."""
    return device_for(trace, chosen, _gpu_device(trace))[0]


@dataclass
class _Calls:
    """The modelled operator calls whose kernels ran and whose inputs the formulas read, one entry
    each, by operator row: `work` indexes `works` (each distinct operator and argument record's
    (name, shapes text, (FLOPs, bytes, dtype)), worked out once: a trace repeats its shapes every
    step), their kernels' time and first kernel's start (us)."""

    rows: np.ndarray
    work: np.ndarray
    kernel_us: np.ndarray
    first_us: np.ndarray
    works: list[tuple[str, str, tuple[float, float, str]]]

    @functools.cached_property
    def flops(self) -> np.ndarray:
        """Each call's FLOPs."""
        return self._per_call(0)

    @functools.cached_property
    def nbytes(self) -> np.ndarray:
        """Each call's bytes moved."""
        return self._per_call(1)

    def _per_call(self, k: int) -> np.ndarray:
        per_work = np.array([w[2][k] for w in self.works], dtype=np.float64)
        return per_work[self.work] if len(self.works) else np.zeros(len(self.rows))

    def dtype_codes(self) -> tuple[np.ndarray, list[str]]:
        """Each call's dtype as a code into the returned names."""
        names = list(dict.fromkeys(w[2][2] for w in self.works))
        per_work = np.array([names.index(w[2][2]) for w in self.works], dtype=np.int64)
        return (per_work[self.work] if len(self.works) else np.zeros(len(self.rows), dtype=np.int64)), names


def _calls(trace: Trace, kernels: np.ndarray, charged: np.ndarray,
           shapes: dict[int, tuple[list, list, list]]) -> tuple[_Calls, int]:
    """The modelled calls (_Calls), and how many more had inputs the formulas could not read."""
    empty = np.empty(0, dtype=np.int64)
    none = _Calls(rows=empty, work=empty, kernel_us=np.empty(0), first_us=np.empty(0), works=[])
    ks = kernels[charged[kernels] >= 0]
    if not len(ks) or not shapes:
        return none, 0
    dur, ts, names, args = trace.col("dur"), trace.col("ts"), trace.col("name"), trace.col("args")
    rows, which = np.unique(charged[ks], return_inverse=True)
    kus = np.bincount(which, weights=dur[ks])
    first = np.full(len(rows), np.inf)
    np.minimum.at(first, which, ts[ks])
    modelled = np.isin(rows, np.fromiter(shapes, dtype=np.int64, count=len(shapes)))
    rows, kus, first = rows[modelled], kus[modelled], first[modelled]
    if not len(rows):
        return none, 0
    keys = (names[rows].astype(np.int64) << 32) | (args[rows].astype(np.int64) & 0xFFFFFFFF)
    _, at, key_of = np.unique(keys, return_index=True, return_inverse=True)
    works = []
    for r in rows[at].tolist():
        name = trace.symbols[int(names[r])]
        dims, types, concrete = shapes[r]
        works.append((name, _shape_text(dims, types), op_work(name, dims, types, concrete)))
    read = np.array([w[2] is not None for w in works], dtype=bool)
    keep = read[key_of.reshape(-1)]
    # (the works the formulas read, renumbered)
    number = np.cumsum(read) - 1
    calls = _Calls(rows=rows[keep], work=number[key_of.reshape(-1)[keep]], kernel_us=kus[keep], first_us=first[keep],
                   works=[w for w, ok in zip(works, read.tolist()) if ok])
    return calls, int((~keep).sum())


def _efficiency(trace: Trace, chosen: str) -> Efficiency:
    device, basis = device_for(trace, chosen, _gpu_device(trace))
    cat, dur = trace.col("cat"), trace.col("dur")
    work = np.flatnonzero(np.isin(cat, GPU_WORK) & ~trace.col("instant"))
    kernels = work[cat[work] == CAT["kernel"]]
    shapes = op_shapes(trace)
    charged = kernel_ops(trace)
    calls, unread = _calls(trace, kernels, charged, shapes)
    ops = _op_stats(calls, device)
    groups = _group_stats(trace, work, charged, calls)
    steps = _step_stats(trace, work, calls, device)
    return Efficiency(device=device, device_basis=basis, has_shapes=bool(shapes), ops=ops, groups=groups,
                      steps=steps, gpu_ms=float(dur[work].sum()) / 1e3, unread_ops=unread)


def _in_first_order(codes: np.ndarray) -> np.ndarray:
    """The distinct values of `codes`, in the order each first appears."""
    values, first = np.unique(codes, return_index=True)
    return values[np.argsort(first)]


def _shape_text(dims: list, types: list) -> str:
    return ", ".join("x".join(map(str, d)) for d, _ in _tensors(dims, types))


def _op_stats(calls: _Calls, device: DeviceSpec | None) -> list[OpStat]:
    # one entry per (name, shapes, dtype), in the order of its first call; sums in the calls' order
    group_of: dict[tuple[str, str, str], int] = {}
    work_group = np.empty(len(calls.works), dtype=np.int64)
    for w in _in_first_order(calls.work).tolist():
        name, shape, (_, _, dtype) = calls.works[w]
        work_group[w] = group_of.setdefault((name, shape, dtype), len(group_of))
    g = work_group[calls.work] if len(calls.works) else np.empty(0, dtype=np.int64)
    n = len(group_of)
    sums = zip(np.bincount(g, minlength=n).tolist(), np.bincount(g, calls.flops, minlength=n).tolist(),
               np.bincount(g, calls.nbytes, minlength=n).tolist(), np.bincount(g, calls.kernel_us, minlength=n).tolist())
    agg = dict(zip(group_of, sums))
    out = []
    for (name, shape, dtype), (count, flops, nbytes, kus) in agg.items():
        secs = kus / 1e6
        tflops = flops / secs / 1e12 if secs > 0 else None
        tbps = nbytes / secs / 1e12 if secs > 0 else None
        intensity = flops / nbytes if nbytes > 0 else None
        share = bound = None
        if device is not None and intensity is not None and tflops is not None and tbps is not None:
            if intensity >= device.ridge_for(dtype):
                bound, share = "compute", tflops / device.peak_tflops(dtype)
            else:
                bound, share = "memory", tbps * 1e3 / device.mem_bw_gbs
        out.append(OpStat(op=name, kind=op_kind(name) or "", shapes=shape, dtype=dtype, count=int(count),
                          kernel_ms=kus / 1e3, flops=flops, bytes=nbytes, tflops=tflops, tbps=tbps,
                          intensity=intensity, peak_share=share, bound=bound))
    out.sort(key=lambda o: -o.kernel_ms)
    return out


def _group_stats(trace: Trace, work: np.ndarray, charged: np.ndarray, calls: _Calls) -> list[GroupStat]:
    cat, dur, names = trace.col("cat"), trace.col("dur"), trace.col("name")
    # the group of each row: by kernel name (each distinct name matched once), memcpy, memset
    groups = [g for g, _ in KERNEL_GROUPS] + ["other", "memcpy", "memset"]
    kernel = cat[work] == CAT["kernel"]
    codes, inv = np.unique(names[work[kernel]], return_inverse=True)
    by_code = np.array([groups.index(kernel_group(trace.symbols[int(c)])) for c in codes.tolist()], dtype=np.int64)
    g = np.where(cat[work] == CAT["memcpy"], groups.index("memcpy"), groups.index("memset")).astype(np.int64)
    g[kernel] = by_code[inv.reshape(-1)] if len(codes) else g[kernel]
    count = np.bincount(g, minlength=len(groups))
    us = np.bincount(g, weights=dur[work], minlength=len(groups))
    fl = np.zeros(len(groups))
    # an operator's FLOPs go to the group of its longest kernel (the first of equal ones)
    ops = charged[work]
    has_flops = np.zeros(len(charged), dtype=bool)
    has_flops[calls.rows] = True
    flops_of = np.zeros(len(charged))
    flops_of[calls.rows] = calls.flops
    mine = np.flatnonzero((ops >= 0) & has_flops[np.maximum(ops, 0)])
    if len(mine):
        order = mine[np.lexsort((mine, -dur[work][mine], ops[mine]))]
        lead = np.r_[True, ops[order][1:] != ops[order][:-1]]
        fl = np.bincount(g[order][lead], flops_of[ops[order][lead]], minlength=len(groups))
    all_us = float(us.sum()) or 1.0
    out = [GroupStat(group=groups[i], kernels=int(count[i]), ms=float(us[i]) / 1e3, share=float(us[i]) / all_us,
                     flops=float(fl[i]), tflops=(float(fl[i]) / (float(us[i]) / 1e6) / 1e12) if fl[i] and us[i] > 0
                     else None)
           for i in np.flatnonzero(count).tolist()]
    out.sort(key=lambda s: -s.ms)
    return out


def _step_stats(trace: Trace, work: np.ndarray, calls: _Calls, device: DeviceSpec | None) -> list[StepGpu]:
    cat, ts, end, names = trace.col("cat"), trace.col("ts"), trace.col("end"), trace.col("name")
    comm_codes = trace.symbols.matching(COMMUNICATION)
    is_kernel = cat[work] == CAT["kernel"]
    is_comm = is_kernel & np.isin(names[work], comm_codes)
    busy = merge_intervals(ts[work], end[work])
    comm = merge_intervals(ts[work[is_comm]], end[work[is_comm]])
    compute = merge_intervals(ts[work[is_kernel & ~is_comm]], end[work[is_kernel & ~is_comm]])
    exposed = subtract(comm, compute)
    spans: list[tuple[int | None, float, float]]
    if len(trace.steps):
        spans = [(int(s), float(a), float(b)) for s, a, b in
                 zip(trace.steps["step"].to_numpy(), trace.steps["ts"].to_numpy(), trace.steps["end"].to_numpy())]
    else:
        lo, hi = trace.window()
        spans = [(None, lo, hi)]
    firsts, flops = calls.first_us, calls.flops
    dtype_of, dtypes = calls.dtype_codes()
    out = []
    for step, lo, hi in spans:
        span_ms = (hi - lo) / 1e3
        busy_ms = total_length(clip(busy, lo, hi)) / 1e3
        inside = (firsts >= lo) & (firsts < hi) if len(firsts) else np.zeros(0, dtype=bool)
        step_flops = float(flops[inside].sum()) if len(calls.rows) else None
        achieved = mfu = None
        if step_flops is not None and span_ms > 0:
            achieved = step_flops / (span_ms / 1e3) / 1e12
            if device is not None and step_flops > 0:
                # the dtype with the most FLOPs (the first of equal ones, in the calls' order)
                mine = np.flatnonzero(inside)
                by_dtype = np.bincount(dtype_of[mine], flops[mine], minlength=len(dtypes))
                main = dtypes[max(_in_first_order(dtype_of[mine]).tolist(), key=lambda d: by_dtype[d])]
                mfu = achieved / device.peak_tflops(main)
        out.append(StepGpu(step=step, device=device.key if device else None, busy_ms=busy_ms,
                           idle_ms=max(span_ms - busy_ms, 0.0), comm_ms=total_length(clip(comm, lo, hi)) / 1e3,
                           exposed_comm_ms=total_length(clip(exposed, lo, hi)) / 1e3, flops=step_flops,
                           achieved_tflops=achieved, mfu=mfu))
    return out


def overlap_ms(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> float:
    """Time two merged interval sets share, in ms."""
    return total_length(intersect(a, b)) / 1e3


def gpu_trace(evidence: Any) -> Trace | None:
    """The trace whose steps findings.json's `steps.gpu` describes: the one whose ProfilerSteps
    the reports show (recordings), else the first with GPU work (a run's profiled window)."""
    shown = evidence.shown_trace()
    if shown is not None:
        return shown
    return next((t for t in evidence.trace_data if np.isin(t.col("cat"), GPU_WORK).any()), None)


def steps_gpu(evidence: Any) -> list[dict[str, Any]] | None:
    """findings.json `steps.gpu`: one StepGpu a step of gpu_trace(), rounded (ms to the
    microsecond, TFLOP/s to 3 decimals, mfu to 4); None when no trace shows GPU work."""
    trace = gpu_trace(evidence)
    if trace is None or not np.isin(trace.col("cat"), GPU_WORK).any():
        return None
    eff = efficiency(trace, evidence.environment.device_model)
    if eff.failed:
        return None

    def r(v: float | None, n: int) -> float | None:
        return None if v is None else round(v, n)

    return [{"step": s.step, "device": s.device, "busy_ms": r(s.busy_ms, 3), "idle_ms": r(s.idle_ms, 3),
             "comm_ms": r(s.comm_ms, 3), "exposed_comm_ms": r(s.exposed_comm_ms, 3),
             "flops": None if s.flops is None else float(round(s.flops)),
             "achieved_tflops": r(s.achieved_tflops, 3), "mfu": r(s.mfu, 4)} for s in eff.steps]
