"""Attention computed by hand in a trace: the chain of operators from the scores' matmul to the
values' matmul (scale, mask, softmax, dropout and dtype casts between them), with the kernels they
launched, found from the operators' argument records (auditor.evidence.trace.arg_records).

A chain is anchored at a softmax over a [.., L, S] tensor (L, S > 1) called by the program (an
operator with no operator around it on its thread). Its scores' matmul is the nearest such matmul
before it on the thread, within CHAIN_OPS operators, that produced that shape ([.., L, E] x
[.., E, S]); its values' matmul the nearest after it that consumes it ([.., L, S] x [.., S, E']).
Every operator the program called in between is part of the chain, and so is every kernel launched
from the thread between the chain's first operator's start and its last one's end (launch calls
matched to their kernels by correlation)."""
from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np

from auditor.evidence.trace.decode import CAT, GPU_WORK, LAUNCH_SIDE
from auditor.evidence.trace.model import Trace

MATMULS = ("aten::matmul", "aten::bmm", "aten::baddbmm", "aten::mm", "aten::einsum")
SOFTMAXES = ("aten::softmax", "aten::_softmax", "aten::_safe_softmax")
# operators a chain may hold between its scores' matmul and its values' matmul, either side of the
# softmax (a scale, the mask's comparison and fill, casts, dropout, views)
CHAIN_OPS = 12


class Chain(msgspec.Struct, frozen=True):
    """One hand-written attention: rows of its scores' matmul, softmax and values' matmul, every
    operator the program called from the first to the last (`ops`, names in `op_names`), the
    kernels they launched (`kernels`), its span on the host (`start`, `end`, us), and its shapes:
    `heads` (batch x heads), `queries` (L), `keys` (S), `qk_dim` (E), `v_dim` (E') and `dtype`
    (the softmax input's, as the profiler names it)."""

    scores: int
    softmax: int
    values: int
    ops: list[int]
    op_names: list[str]
    kernels: list[int]
    start: float
    end: float
    heads: int
    queries: int
    keys: int
    qk_dim: int
    v_dim: int
    dtype: str

    def flops(self) -> float:
        """The forward FLOPs of the attention itself (both matmuls): what a fused kernel computes."""
        return 2.0 * self.heads * self.queries * self.keys * (self.qk_dim + self.v_dim)


def _bmn(dims: Any) -> tuple[int, int, int] | None:
    """(batch elements, rows, columns) of a >= 2-d shape."""
    if not dims or len(dims) < 2:
        return None
    return (math.prod(dims[:-2]) if len(dims) > 2 else 1, dims[-2], dims[-1])


def _mats(trace: Trace, row: int) -> list[tuple[int, int, int]]:
    rec = trace.arg_record(row)
    return [m for d, _ in (rec.tensors() if rec else []) if (m := _bmn(d)) is not None]


def _produces(mats: list[tuple[int, int, int]], s: tuple[int, int, int]) -> int | None:
    """E when [.., L, E] x [.., E, S] makes the scores `s`."""
    if len(mats) < 2:
        return None
    a, b = mats[-2], mats[-1]
    if a[1] == s[1] and b[2] == s[2] and a[2] == b[1] and max(a[0], b[0]) == s[0]:
        return a[2]
    return None


def _consumes(mats: list[tuple[int, int, int]], s: tuple[int, int, int]) -> int | None:
    """E' when [.., L, S] x [.., S, E'] takes the scores `s`."""
    if len(mats) < 2:
        return None
    a, b = mats[0], mats[1]
    if a == s and b[1] == s[2] and b[0] == s[0]:
        return b[2]
    return None


def called_ops(trace: Trace) -> np.ndarray:
    """Rows of the operators the program called itself: no operator encloses them on their thread
    (an `aten::matmul`, not the `aten::bmm` it runs), in (thread, start) order."""
    cached = trace.__dict__.get("_called_ops")
    if cached is not None:
        return cached
    cat, parent = trace.col("cat"), trace.col("parent")
    ops = np.flatnonzero((cat == CAT["cpu_op"]) & ~trace.col("instant"))
    # the nearest enclosing operator of each, by pointer jumping over non-operator ancestors
    # (only the walks still under way are stepped)
    up = parent[ops].copy()
    live = np.flatnonzero(up >= 0)
    while len(live):
        live = live[cat[up[live]] != CAT["cpu_op"]]
        up[live] = parent[up[live]]
        live = live[up[live] >= 0]
    rows = ops[up < 0]
    rows = rows[np.lexsort((trace.col("ts")[rows], trace.col("tid")[rows], trace.col("pid")[rows]))]
    trace.__dict__["_called_ops"] = rows
    return rows


def attention_chains(trace: Trace) -> list[Chain]:
    """Every hand-written attention chain in the trace (module docstring); cached per trace.

    Costs a few Python steps per softmax: an operator's shapes are read once per argument record, a
    thread's called operators are one run of called_ops (a chain's window ends at its run's ends),
    and the kernels of every chain are found at once (_kernels_of)."""
    cached = trace.__dict__.get("_attention_chains")
    if cached is not None:
        return cached
    out: list[Chain] = []
    trace.__dict__["_attention_chains"] = out
    if "args" not in trace.events:
        return out
    soft_codes = [c for c in (trace.symbols.id(n) for n in SOFTMAXES) if c >= 0]
    mm_codes = [c for c in (trace.symbols.id(n) for n in MATMULS) if c >= 0]
    if not soft_codes or not mm_codes:
        return out
    rows = called_ops(trace)
    if not len(rows):
        return out
    names, pid, tid = trace.col("name"), trace.col("pid"), trace.col("tid")
    ts, end, records = trace.col("ts"), trace.col("end"), trace.col("args")
    is_mm = np.isin(names[rows], mm_codes).tolist()
    # rows are in (thread, start) order: each thread's called operators are one run [run_lo, run_hi)
    new_run = np.r_[True, (pid[rows][1:] != pid[rows][:-1]) | (tid[rows][1:] != tid[rows][:-1])]
    run_lo = np.maximum.accumulate(np.where(new_run, np.arange(len(rows)), 0))
    run_hi = np.r_[np.flatnonzero(new_run)[1:], len(rows)][np.cumsum(new_run) - 1]
    mats_of: dict[int, list[tuple[int, int, int]]] = {}  # argument record code -> its matrices

    def mats(row: int) -> list[tuple[int, int, int]]:
        code = int(records[row])
        got = mats_of.get(code)
        if got is None:
            got = mats_of[code] = _mats(trace, row)
        return got

    found = []
    for i in np.flatnonzero(np.isin(names[rows], soft_codes)).tolist():
        r = int(rows[i])
        rec = trace.arg_record(r)
        s = _bmn(rec.dims[0]) if rec and rec.dims and rec.dims[0] else None
        if s is None or s[1] <= 1 or s[2] <= 1:
            continue
        lo, hi = max(int(run_lo[i]), i - CHAIN_OPS), min(int(run_hi[i]), i + 1 + CHAIN_OPS)
        scores = values = e_qk = e_v = None
        for j in range(i - 1, lo - 1, -1):
            if is_mm[j] and (e_qk := _produces(mats(int(rows[j])), s)) is not None:
                scores = j
                break
        for j in range(i + 1, hi):
            if is_mm[j] and (e_v := _consumes(mats(int(rows[j])), s)) is not None:
                values = j
                break
        if scores is None or values is None or e_qk is None or e_v is None:
            continue
        ops = rows[scores:values + 1]  # (one thread's run: every row of it is the thread's)
        found.append((r, s, rec, ops, e_qk, e_v, float(ts[ops[0]]), float(end[ops].max())))
    kernels = _kernels_of(trace, [int(f[3][0]) for f in found], [f[6] for f in found], [f[7] for f in found])
    for (r, s, rec, ops, e_qk, e_v, t0, t1), ks in zip(found, kernels):
        out.append(Chain(scores=int(ops[0]), softmax=r, values=int(ops[-1]), ops=ops.tolist(),
                         op_names=[trace.symbols[c] for c in names[ops].tolist()], kernels=ks, start=t0, end=t1,
                         heads=s[0], queries=s[1], keys=s[2], qk_dim=e_qk, v_dim=e_v,
                         dtype=rec.types[0] if rec.types else ""))
    return out


def _kernels_of(trace: Trace, first: list[int], t0: list[float], t1: list[float]) -> list[list[int]]:
    """For each chain (its first operator's row, its span [t0, t1]): the GPU rows (kernels, copies,
    memsets) of the launches its thread started in [t0, t1), in launch order, each launch's rows by
    row; all chains at once."""
    out: list[list[int]] = [[] for _ in first]
    if not first:
        return out
    launches = _launches_by_thread(trace)
    owners, gpu = _gpu_by_launch(trace)
    pid, tid = trace.col("pid"), trace.col("tid")
    first_rows = np.asarray(first, dtype=np.int64)
    t0s, t1s = np.asarray(t0, dtype=np.float64), np.asarray(t1, dtype=np.float64)
    for key, chains in _by_key(pid[first_rows], tid[first_rows]).items():
        thread = launches.get(key)
        if thread is None or not len(thread[0]):
            continue
        rows, starts = thread
        a = np.searchsorted(starts, t0s[chains], side="left")
        b = np.searchsorted(starts, t1s[chains], side="left")
        n = np.maximum(b - a, 0)
        mine = rows[_ranges(a, n)]  # every chain's launches, chain after chain
        lo, hi = np.searchsorted(owners, mine, side="left"), np.searchsorted(owners, mine, side="right")
        per_launch = hi - lo
        ks = gpu[_ranges(lo, per_launch)]
        # each chain's kernels: those of its launches (the launches' counts summed chain by chain)
        upto = np.r_[0, np.cumsum(per_launch)][np.cumsum(n)]
        for c, got in zip(chains.tolist(), np.split(ks, upto[:-1])):
            out[c] = got.tolist()
    return out


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """starts[0] .. starts[0]+counts[0]-1, then starts[1] .., as one index array."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if not total:
        return np.empty(0, dtype=np.int64)
    return np.repeat(np.asarray(starts, dtype=np.int64) - np.cumsum(counts) + counts, counts) + np.arange(total)


def _by_key(pid: np.ndarray, tid: np.ndarray) -> dict[tuple[int, int], np.ndarray]:
    """Positions 0..n-1 grouped by (pid, tid), each group in order."""
    groups: dict[tuple[int, int], list[int]] = {}
    for k, key in enumerate(zip(pid.tolist(), tid.tolist())):
        groups.setdefault(key, []).append(k)
    return {key: np.asarray(v, dtype=np.int64) for key, v in groups.items()}


def _launches_by_thread(trace: Trace) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
    """The launch calls that reached the GPU (linked to a GPU row), per host thread, by start: (rows,
    their starts)."""
    cat, link = trace.col("cat"), trace.col("link")
    rows = np.flatnonzero(np.isin(cat, LAUNCH_SIDE) & (link >= 0))
    if not len(rows):
        return {}
    pid, tid, ts = trace.col("pid"), trace.col("tid"), trace.col("ts")
    rows = rows[np.lexsort((ts[rows], tid[rows], pid[rows]))]
    # (sorted by thread: each thread's rows are one run)
    cut = np.flatnonzero((pid[rows][1:] != pid[rows][:-1]) | (tid[rows][1:] != tid[rows][:-1])) + 1
    return {(int(pid[g[0]]), int(tid[g[0]])): (g, ts[g]) for g in np.split(rows, cut)}


def _gpu_by_launch(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """(launch row, GPU row) of every kernel, copy and memset with a recorded launch, by launch row."""
    cached = trace.__dict__.get("_gpu_by_launch")
    if cached is None:
        link = trace.col("link")
        gpu = np.flatnonzero(np.isin(trace.col("cat"), GPU_WORK) & (link >= 0))
        order = np.argsort(link[gpu], kind="stable")
        cached = trace.__dict__["_gpu_by_launch"] = (link[gpu][order], gpu[order])
    return cached
