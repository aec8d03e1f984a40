"""Steps of a trace: its ProfilerStep ranges (find_steps reads those first), else, for a recording
without a profiler schedule, one step per iteration of the training loop, as `prof.step()` would
mark it (why iterations, not optimizer steps: docs/schemas.md); assign_steps gives every event its
step's number.

- With DataLoader fetches on the thread that steps the optimizers, an iteration begins at a fetch
  (fetches with no work between them begin one) and ends at the end of its last optimizer step, or
  where the next fetch begins when it steps none (gradient accumulation).
- Without them, the optimizer steps per iteration are the smallest period with which the steps'
  descriptions (the range's name, its operators, the autograd nodes of the backward pass before it)
  repeat over the recording's last two thirds; steps that cannot be told apart are a step each.

What comes before the first iteration's end is left out, as a schedule's warm-up would be; with
fewer than two steps found there are none (the recording is judged as one window).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from auditor.evidence.trace.decode import CAT, GPU_SIDE, STEP_NAME
from auditor.evidence.trace.model import Trace

if TYPE_CHECKING:  # (pandas is imported where a trace is read: an audit without one never pays for it)
    import pandas as pd

OPTIMIZER_STEP = re.compile(r"^Optimizer\.step#.+\.step$")
LOADER_FETCH = re.compile(r"^enumerate\(DataLoader\)#.*__next__$")
BACKWARD_NODE = re.compile(r"^autograd::engine::evaluate_function: ")
MAX_OPTIMIZERS_PER_FETCH = 4  # more optimizer steps per fetch than this: an outer loop's fetch, not the iteration's


@dataclass
class Split:
    """Steps taken from a trace without ProfilerSteps, and how (the note's words after 'its N steps')."""

    steps: pd.DataFrame
    how: str


def find_steps(trace: Trace) -> tuple[pd.DataFrame, str | None]:
    """The trace's steps (Trace.steps' frame) and, when they are not its ProfilerSteps, how they
    were taken (Trace.steps_from): the CPU-side ProfilerStep ranges in time order, else the
    iterations split_without_schedule finds, else no steps."""
    import pandas as pd
    ev = trace.events
    codes = trace.symbols.matching(STEP_NAME)
    sel = ev[ev["name"].isin(codes) & ev["cat"].isin((CAT["annotation"], CAT["cpu_op"])) & ~ev["instant"]]
    numbers = [int(STEP_NAME.match(trace.symbols[int(c)]).group(1)) for c in sel["name"]]  # type: ignore[union-attr]
    steps = pd.DataFrame({"step": np.asarray(numbers, dtype=np.int64), "row": sel.index.to_numpy(),
                          "ts": sel["ts"].to_numpy(), "end": sel["end"].to_numpy(),
                          "dur": sel["dur"].to_numpy()}).sort_values("ts").reset_index(drop=True)
    if len(steps):
        return steps, None
    split = split_without_schedule(trace)
    if split is None:
        return steps, None
    return split.steps, split.how


def assign_steps(trace: Trace) -> np.ndarray:
    """Step number of each row (-1 outside any step): CPU rows by time, GPU rows by the step of
    their launch."""
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


def split_without_schedule(trace: Trace) -> Split | None:
    """The trace's iterations as steps (see the module's docstring), or None when fewer than two
    can be told."""
    import pandas as pd
    opt = _outermost(trace, OPTIMIZER_STEP)
    if len(opt) < 2:
        return None
    pid, tid = trace.col("pid"), trace.col("tid")
    threads = pd.Series(list(zip(pid[opt].tolist(), tid[opt].tolist())))
    thread = threads.value_counts().idxmax()  # the training loop's thread
    opt = opt[(pid[opt] == thread[0]) & (tid[opt] == thread[1])]
    fetches = _outermost(trace, LOADER_FETCH, thread)
    names = sorted({trace.name(int(r)) for r in opt})
    label = names[0] if len(names) == 1 else " / ".join(names)
    split = _by_fetches(trace, opt, fetches, thread, label) if len(fetches) else None
    return split or _by_pattern(trace, opt, label)


def _outermost(trace: Trace, pattern: re.Pattern[str], thread: tuple[int, int] | None = None) -> np.ndarray:
    """Rows of the ranges `pattern` names (record_function annotations; operators in the old
    schema), not inside another such range of their thread, in time order."""
    codes = trace.symbols.matching(pattern)
    if not len(codes):
        return np.empty(0, dtype=np.int64)
    cat, instant = trace.col("cat"), trace.col("instant")
    mask = np.isin(trace.col("name"), codes) & np.isin(cat, (CAT["annotation"], CAT["cpu_op"])) & ~instant
    if thread is not None:
        mask &= (trace.col("pid") == thread[0]) & (trace.col("tid") == thread[1])
    rows = np.flatnonzero(mask)
    out = []
    for key in set(zip(trace.col("pid")[rows].tolist(), trace.col("tid")[rows].tolist())):
        mine = rows[(trace.col("pid")[rows] == key[0]) & (trace.col("tid")[rows] == key[1])]
        mine = mine[np.argsort(trace.col("ts")[mine], kind="stable")]
        ends = np.maximum.accumulate(trace.col("end")[mine])
        inside = np.zeros(len(mine), dtype=bool)
        inside[1:] = trace.col("ts")[mine][1:] < ends[:-1]
        out.append(mine[~inside])
    rows = np.concatenate(out) if out else rows
    return rows[np.argsort(trace.col("ts")[rows], kind="stable")]


def _frame(ends: np.ndarray) -> pd.DataFrame:
    import pandas as pd
    return pd.DataFrame({"step": np.arange(1, len(ends), dtype=np.int64),
                         "row": np.full(len(ends) - 1, -1, dtype=np.int64), "ts": ends[:-1], "end": ends[1:],
                         "dur": np.diff(ends)})


def _by_fetches(trace: Trace, opt: np.ndarray, fetches: np.ndarray, thread: tuple[int, int],
                label: str) -> Split | None:
    """Iterations begun by the loop's DataLoader fetches, each ended by its last optimizer step
    (or the next fetch); None when the fetches do not mark iterations (too few, or an outer loop's)."""
    ts, end, cat = trace.col("ts"), trace.col("end"), trace.col("cat")
    on_thread = (trace.col("pid") == thread[0]) & (trace.col("tid") == thread[1])
    work = np.sort(ts[np.flatnonzero(on_thread & (cat == CAT["cpu_op"]) & ~trace.col("instant"))])
    f_ts, f_end = ts[fetches], end[fetches]
    # a fetch begins an iteration when the loop did some work since the previous one ended
    between = np.searchsorted(work, f_ts[1:], side="left") - np.searchsorted(work, f_end[:-1], side="right")
    starts = f_ts[np.r_[True, between > 0]]
    o_ts, o_end = ts[opt], end[opt]
    which = np.searchsorted(starts, o_ts, side="right") - 1
    inside = which >= 0
    per_iter = np.bincount(which[inside], minlength=len(starts))
    last_end = np.full(len(starts), np.nan)
    np.fmax.at(last_end, which[inside], o_end[inside])
    ends = np.where(per_iter > 0, last_end, np.r_[starts[1:], np.nan])
    ends = ends[~np.isnan(ends)]
    complete = per_iter[:len(ends)][1:]  # the iterations that became steps (the first is left out)
    if len(ends) < 3 or not complete.any() or np.median(complete) > MAX_OPTIMIZERS_PER_FETCH:
        return None
    if (complete == 1).all():  # one optimizer step an iteration: its ends are the steps' ends
        return Split(_frame(ends), f"are taken from the end of one {label} to the end of the next")
    how = (f"are the loop's iterations, told apart by its DataLoader fetches, each from the end of one "
           f"iteration's last {label} to the end of the next")
    if len(set(complete.tolist())) == 1:
        return Split(_frame(ends), f"{how}: {int(complete[0])} optimizer steps an iteration")
    how += f": {int(complete.min())} to {int(complete.max())} optimizer steps an iteration"
    without = int((complete == 0).sum())
    if without:
        how += (f"; an iteration with none (gradient accumulation: {without} of the {len(complete)}) ends where "
                f"the next fetch begins")
    return Split(_frame(ends), how)


def _by_pattern(trace: Trace, opt: np.ndarray, label: str) -> Split | None:
    """Iterations of `period` optimizer steps, the smallest period with which the steps'
    descriptions (optimizer, operators it runs, backward nodes before it) repeat."""
    ts, end, cat, names = trace.col("ts"), trace.col("end"), trace.col("cat"), trace.col("name")
    on_thread = (trace.col("pid") == trace.col("pid")[opt[0]]) & (trace.col("tid") == trace.col("tid")[opt[0]])
    ops = np.sort(ts[np.flatnonzero(on_thread & (cat == CAT["cpu_op"]) & ~trace.col("instant"))])
    nodes = np.sort(ts[np.flatnonzero(np.isin(names, trace.symbols.matching(BACKWARD_NODE)) & ~trace.col("instant"))])
    o_ts, o_end = ts[opt], end[opt]
    in_range = np.searchsorted(ops, o_end, side="left") - np.searchsorted(ops, o_ts, side="left")
    before = np.r_[-np.inf, o_end[:-1]]
    backward = np.searchsorted(nodes, o_ts, side="left") - np.searchsorted(nodes, before, side="left")
    described = list(zip(names[opt].tolist(), in_range.tolist(), backward.tolist()))
    period = _period(described)
    ends = np.sort(o_end)[period - 1::period]
    if len(ends) < 3:
        return None
    if period == 1:
        return Split(_frame(ends), f"are taken from the end of one {label} to the end of the next")
    return Split(_frame(ends), f"are taken from the end of one run of {period} {label} to the end of the next: "
                               f"the pattern their optimizers and backward passes repeat, taken as one iteration")


def _period(described: list[tuple[int, int, int]]) -> int:
    """The smallest p with described[i] == described[i + p] throughout the last two thirds (two
    whole periods at least); 1 when none."""
    n = len(described)
    tail = n // 3
    for p in range(1, (n - tail) // 2 + 1):
        if all(described[i] == described[i + p] for i in range(tail, n - p)):
            return p
    return 1
