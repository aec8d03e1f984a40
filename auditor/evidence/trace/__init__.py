"""Parse a PyTorch profiler (Kineto) Chrome trace into columnar evidence the trace rules query
(streaming and decoding: auditor.evidence.trace.decode; in worker processes: trace_parallel).

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
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from auditor.evidence.trace import parallel as trace_parallel
from auditor.evidence.errors import InputError
from auditor.evidence.model import Frame  # noqa: F401  (re-exported for rules)
from auditor.evidence.recorded_frames import is_library_file, parse_frame  # noqa: F401
from auditor.evidence.trace.decode import (  # noqa: F401  (the vocabulary is re-exported for rules)
    CAT,
    CATEGORIES,  # noqa: F401
    CPU_NESTING,
    DEFAULT_CHUNK_BYTES,
    FLOW_CATEGORIES,  # noqa: F401
    GPU_SIDE,
    GPU_WORK,
    LAUNCH_SIDE,
    STEP_NAME,
    SymbolTable,
    _Columns,
    _decode_args,
    _Stream,
)

# record_function ranges the auditor runs its own work in (e.g. `auditor::numerics` around the
# numerics collector's checks): every operator inside one was the audit's, not the program's
AUDITOR_RANGE = re.compile(r"^auditor::")
# The profiler's Python tracer records the frames already running when it starts within
# microseconds of its first event (Trace.startup_frames); later calls come after its own start-up.
STARTUP_WINDOW_US = 1000.0
_TORCH_VERSION_KEY = re.compile(r"^(?:py)?torch[_ ]?version$", re.IGNORECASE)
_VERSION = re.compile(r"^\d+\.\d+(?:\.\d+)?(?:[-+.\w]*)$")


# ---------------------------------------------------------------------------------------------
def _frames(cols: _Columns) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The events and flows frames from the accumulated columns (each concatenated once)."""
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
    workers: int = 0  # processes that decoded it (trace_parallel), 0 when this one did
    # Events left out because a field they need had a value of the wrong type, said as a sentence
    # (empty: none): the report says so, since what they held is missing from every number.
    dropped: str = ""
    # How messages name it: its file name, or its path in the TensorBoard logdir it was found in
    # (`run-a/host.pt.trace.json`: a logdir's runs often share file names; set by evidence.load).
    label: str = ""

    def __post_init__(self) -> None:
        self.label = self.label or Path(self.path).name

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
    def torch_version(self) -> str | None:
        """The torch version the trace says it was recorded with, or None. torch writes none into
        its traces; a recording tool or the user may (`prof.add_metadata("torch_version", ...)`, a
        harness's `metadata.system.torch_env_info.torch_version`): the first `torch_version` /
        `pytorch_version` key, to five levels down, whose value reads as a version."""
        level: list[Any] = [self.metadata]
        for _ in range(5):
            nested: list[Any] = []
            for d in level:
                for key, value in d.items():
                    if isinstance(value, dict):
                        nested.append(value)
                    elif (_TORCH_VERSION_KEY.match(str(key)) and isinstance(value, str)
                          and _VERSION.match(value.strip())):
                        return value.strip()[:40]
            level = nested
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
    def auditor_ranges(self) -> np.ndarray:
        """Rows of the auditor's own `auditor::` ranges (record_function annotations, e.g.
        `auditor::numerics` around the numerics checks) in a trace of an audited run."""
        cached = self.__dict__.get("_auditor_ranges")
        if cached is None:
            codes = self.symbols.matching(AUDITOR_RANGE)
            cached = self.__dict__["_auditor_ranges"] = (
                np.flatnonzero((self.col("cat") == CAT["annotation"]) & np.isin(self.col("name"), codes)
                               & ~self.col("instant")) if len(codes) else np.empty(0, dtype=np.int64))
        return cached

    def auditor_rows(self) -> np.ndarray:
        """A boolean per row: it started inside one of the auditor's ranges on its thread (an
        operator, a runtime call), so it was the audit's work, not the program's.

        Why by range and not by name or stack: the audit runs the same operators as the program
        (aminmax, item, norms), and the program's own calls pass through the auditor's wrappers
        (its TorchFunctionMode, its probes), so neither an op's name nor an auditor frame above it
        says whose call it was; the range says it exactly. Containment is judged on time per
        thread, not through the trace's parent links, which Python-tracer events that outlive
        their call bend."""
        cached = self.__dict__.get("_auditor_rows")
        if cached is not None:
            return cached
        ranges = self.auditor_ranges()
        pid, tid, ts, end = self.col("pid"), self.col("tid"), self.col("ts"), self.col("end")
        inside = np.zeros(len(ts), dtype=bool)
        for p, t in set(zip(pid[ranges].tolist(), tid[ranges].tolist())):
            mine = ranges[(pid[ranges] == p) & (tid[ranges] == t)]
            lo, hi = merge_intervals(ts[mine], end[mine])
            rows = np.flatnonzero((pid == p) & (tid == t))
            k = np.searchsorted(lo, ts[rows], side="right") - 1
            hit = k >= 0
            inside[rows[hit]] = ts[rows[hit]] < hi[k[hit]]
        self.__dict__["_auditor_rows"] = inside
        return inside

    def top_ops(self, limit: int = 20, exclude: np.ndarray | None = None,
                also_nested: np.ndarray | None = None) -> list[dict[str, Any]]:
        """Operators by self time (their time minus the operators and runtime calls nested in
        them), as the profiler's `key_averages()` table has them: [{"name", "count", "self_ms",
        "total_ms"}]. Computed from the columns in milliseconds; the profiler's own table of a
        window recorded with stacks and shapes costs seconds in the audited process. `exclude`
        (a row mask) leaves rows out, as operators and as nested time; `also_nested` (rows) are
        taken out of their parents' self time too (the auditor's own annotated ranges)."""
        cat, dur, parent, name = self.col("cat"), self.col("dur"), self.col("parent"), self.col("name")
        keep = ~exclude if exclude is not None else True
        ops = np.flatnonzero((cat == CAT["cpu_op"]) & ~self.col("instant") & keep)
        if not len(ops):
            return []
        timed = np.isin(cat, (CAT["cpu_op"], CAT["runtime"], CAT["driver"])) & keep
        if also_nested is not None:
            timed[also_nested] = True
        nested = np.flatnonzero(timed & (parent >= 0))
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
        """The CPU-side ProfilerStep ranges: step number, ts, end, dur (us), in time order; for a
        trace without them, the steps its optimizer's steps delimit (steps_from)."""
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
        if not len(steps):
            steps = self._optimizer_steps(steps)
        self.__dict__["_steps"] = steps
        return steps

    @property
    def steps_from(self) -> str | None:
        """How the steps were taken when the trace has no ProfilerSteps, in the words that follow
        'its N steps' (`are taken from the end of one Optimizer.step#SGD.step to the end of the
        next`); None otherwise."""
        self.steps  # noqa: B018  (found with them)
        return self.__dict__.get("_steps_from")

    def _optimizer_steps(self, empty: pd.DataFrame) -> pd.DataFrame:
        """Steps of a trace recorded without a schedule (`with profile(): ...`, which writes no
        ProfilerStep ranges): the training loop's iterations, found from its DataLoader fetches and
        torch.optim's `Optimizer.step#<class>.step` ranges (auditor.evidence.trace.steps says how
        and why). Fewer than two: no steps (the whole recording is judged, as before)."""
        from auditor.evidence.trace.steps import split_without_schedule

        split = split_without_schedule(self)
        if split is None:
            return empty
        self.__dict__["_steps_from"] = split.how
        return split.steps

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

    def median_step_ms(self) -> float:
        """Median ProfilerStep in ms (the whole window when there are none): what a cost found in
        this trace is a share of, as the report's median step is for a run."""
        steps = self.steps
        if not len(steps):
            return self.step_ms()
        return statistics.median(float(d) / 1000.0 for d in steps["dur"])

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

    def startup_frames(self) -> dict[int, int]:
        """Python frames that were already running when the profiler started, each mapped to the
        row of the call it was making then.

        Why: the profiler's Python tracer names a call it sees begin by the function's first line,
        but a frame already on the stack when it starts (the function holding `with profile():` or
        calling `prof.step()`, and the callers above it) by the line that frame was on at that
        moment, and keeps that name for the frame's whole life. Work the frame does later (the
        next batch, the next step) is recorded under the same name, so that line, the profiler's
        own, is not where it was done. The tracer records those frames first, all within
        microseconds of its start, on every thread: each thread's outermost early frame, then the
        earliest call inside each, down to the first library frame below the user's code (the
        profiler's own start on the thread that started it)."""
        cached = self.__dict__.get("_startup_frames")
        if cached is not None:
            return cached
        out: dict[int, int] = {}
        cat, ts, parent, names = self.col("cat"), self.col("ts"), self.col("parent"), self.col("name")
        py = np.flatnonzero((cat == CAT["python"]) & ~self.col("instant"))
        if len(py):
            early = py[ts[py] <= ts[py].min() + STARTUP_WINDOW_US]
            early = early[np.argsort(ts[early], kind="stable")]
            first_child: dict[int, int] = {}
            for r in early.tolist():
                first_child.setdefault(int(parent[r]), r)
            known = set(early.tolist())
            threads: set[tuple[int, int]] = set()
            pid, tid = self.col("pid"), self.col("tid")
            for root in early.tolist():
                thread = (int(pid[root]), int(tid[root]))
                if int(parent[root]) in known or thread in threads:
                    continue
                threads.add(thread)
                r, seen_user = root, False
                while r in first_child or r == root:
                    f = parse_frame(self.symbols[int(names[r])])
                    user = f is not None and not is_library_file(f.file)
                    if seen_user and not user:
                        break
                    seen_user = seen_user or user
                    child = first_child.get(r)
                    if child is None:
                        break
                    out[r] = child
                    r = child
        self.__dict__["_startup_frames"] = out
        return out

    def user_frame(self, row: int) -> Frame | None:
        """The innermost frame outside torch, the standard library and site-packages.

        Memoised per row: every row on a walked chain gets the answer, so attributing thousands
        of kernels costs one walk per distinct call site. A frame that was running when the
        profiler started names the line it was on then, which holds only for rows that began
        before the call it was making returned; later rows get started_frame's answer. That is
        judged on time, not on the chain: a ProfilerStep range opens inside `prof.step()` and
        outlives it, so the rows of every step hang below the call that started the profiler.
        """
        cache: dict[int, tuple[Frame | None, int]] = self.__dict__.setdefault("_user_frames", {})
        cat = self.col("cat")
        link = self.col("link")
        if cat[row] in GPU_SIDE and link[row] >= 0:
            row = int(link[row])
        parent = self.col("parent")
        stack = self.col("stack")
        names = self.col("name")
        startup = self.startup_frames()
        path: list[int] = []
        found: tuple[Frame | None, int] = (None, -1)  # (the frame, its row when it ran before the profiler)
        r = row
        while r >= 0:
            if r in cache:
                found = cache[r]
                break
            path.append(r)
            if cat[r] == CAT["python"]:
                f = parse_frame(self.symbols[int(names[r])])
                if f is not None and not is_library_file(f.file):
                    found = (f, r if r in startup else -1)
                    break
            elif stack[r] >= 0:
                for part in self.symbols[int(stack[r])].split(";"):
                    f = parse_frame(part)
                    if f is not None and not is_library_file(f.file):
                        found = (f, -1)
                        break
                break
            r = int(parent[r])
            if len(path) > 10_000:  # a cycle cannot happen by construction; stay safe anyway
                break
        for p in path:
            cache[p] = found
        frame, early = found
        if frame is None or early < 0 or self.col("ts")[row] < self.col("end")[startup[early]]:
            return frame
        moved: dict[Frame, Frame] = self.__dict__.setdefault("_started_frames", {})
        if frame not in moved:
            moved[frame] = started_frame(frame)
        return moved[frame]


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
    events, flows = _frames(cols)
    if not len(events) and stream.dropped:  # every event was of the wrong shape: nothing to judge
        raise InputError(f"{path}: not a usable profiler trace: {_dropped_text(stream)}, and no other timed "
                         f"events are left")
    if not len(events):  # `[]`, or only metadata: a report of it would read "no findings"
        raise InputError(f"{path}: not a profiler trace: it holds no timed events")
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
    trace.dropped = _dropped_text(stream) if stream.dropped else ""
    events["step"] = _assign_steps(trace)
    return trace


def _dropped_text(stream: _Stream) -> str:
    n = stream.dropped
    return (f"{n:,} event{'s' if n != 1 else ''} with fields of the wrong type "
            f"{'were' if n != 1 else 'was'} left out (the first: {stream.dropped_why})")


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


def load_trace(path: Path | str, chunk_bytes: int = DEFAULT_CHUNK_BYTES, workers: int | None = None) -> Trace:
    """Parse a Kineto/Chrome trace (`.json` or `.json.gz`) with bounded memory.

    A large file is decoded by `workers` processes (default: trace_parallel.worker_count, one per
    core for files of 48 MB and more); 0 or 1 parses in this process. Either way gives the same
    Trace. Raises InputError, with one line naming the file, for missing, truncated, malformed or
    non-trace inputs.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such trace file")
    if workers is None:
        workers = trace_parallel.worker_count(path)
    # No cyclic garbage collection while parsing: millions of short-lived lists and arrays would
    # trigger full collections that walk every object of the process (plotly, pandas...) again and
    # again, for cycles the parser never makes.
    collecting = gc.isenabled()
    gc.disable()
    try:
        if workers > 1:
            try:
                return _parse(path, chunk_bytes, workers)
            except Exception:  # a worker failed: the one-process parse gives the exact error, or succeeds
                pass
        return _parse(path, chunk_bytes, 0)
    finally:
        if collecting:
            gc.enable()


def _parse(path: Path, chunk_bytes: int, workers: int) -> Trace:
    symbols = SymbolTable()
    cols = _Columns(symbols)
    stream = _Stream(path, chunk_bytes)
    try:
        stream.start()
        if workers > 1:
            trace_parallel.parse(stream, cols, workers)
        else:
            for events, has_stacks in stream.chunks():
                cols.add(events, has_stacks)
        trace = _finish(path, stream, cols, symbols)
        trace.workers = workers if workers > 1 else 0
        return trace
    finally:
        stream.reader.close()


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
# asynchronous copies that still block the host: to pageable memory, the call returns only once
# the copy is done, after all the work queued before it (`.cpu()`, `.to("cpu")`, `.numpy()`)
ASYNC_COPY_CALLS = ("cudaMemcpyAsync", "cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync", "hipMemcpyAsync")
PAGEABLE_DTOH = re.compile(r"DtoH.*Pageable")


def blocking_calls(trace: "Trace") -> np.ndarray:
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


def blocking_op_calls(trace: "Trace", rows: np.ndarray) -> np.ndarray:
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


def gpu_idle_behind(trace: "Trace", rows: np.ndarray) -> float:
    """Microseconds of GPU idle time that blocking calls (`rows`) account for: while the host
    waits in a call, and after it returns until the GPU next starts work, whatever no GPU work
    covers (a union over the calls). A sync that waits on a busy GPU costs little of it: the
    work it waits for runs anyway; what a sync takes away is the queue the host would have kept
    filling, so the GPU runs dry behind it. Time the host then spends loading data is left out:
    the GPU would wait for that batch with or without the sync (gpu-idle and dataloader-bound
    name it)."""
    if not len(rows):
        return 0.0
    busy = gpu_busy(trace)
    starts = busy[0]
    end = trace.col("end")[rows].astype(np.float64)
    nxt = np.searchsorted(starts, end, side="left")
    resume = starts[np.minimum(nxt, len(starts) - 1)] if len(starts) else end
    resume = np.where(nxt < len(starts), resume, end)
    spans = merge_intervals(trace.col("ts")[rows].astype(np.float64), np.maximum(resume, end))
    loader = trace.matching(DATALOADER_NEXT)
    loading = merge_intervals(loader["ts"].to_numpy(), loader["end"].to_numpy())
    return total_length(subtract(subtract(spans, busy), loading))


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


class StartedFrame(Frame, frozen=True):
    """A frame named by the line it was on when the profiler started (Trace.startup_frames), for
    work it did later: where that work was done is somewhere else in the function, and the
    function's own first line could not be found (its file is not on this disk)."""


def started_frame(frame: Frame) -> Frame:
    """`frame`, seen running when the profiler started, as the place of work it did later: its
    function's `def` line when the source is here (a Location then says the trace records the
    function, not the line), else the recorded line marked as the profiler's (StartedFrame)."""
    start = _def_line(frame.file, frame.line, frame.function)
    if start is not None:
        return Frame(file=frame.file, line=start, function=frame.function)
    return StartedFrame(file=frame.file, line=frame.line, function=frame.function)


_DEF = re.compile(r"^(\s*)(?:async\s+)?def\s+(\w+)\s*[(\[]")


def _def_line(file: str, line: int, function: str) -> int | None:
    """The line of `def function` that encloses `line` in `file` (None for module code, or when
    the file cannot be read here)."""
    import linecache

    lines = linecache.getlines(file) if file else []
    if not (0 < line <= len(lines)) or not function.isidentifier():
        return None
    indent = len(lines[line - 1]) - len(lines[line - 1].lstrip())
    for n in range(line - 1, 0, -1):
        m = _DEF.match(lines[n - 1])
        if m and len(m.group(1)) < indent:  # the def whose body holds the line
            return n if m.group(2) == function else None
    return None


def frame_location_parts(frame: Frame) -> tuple[str, int, str, str]:
    """(file, line, source line, note) for a Location: the source only when the file is on this
    disk, and the note saying what the place stands for when the trace does not name the line that
    did the work (a function's def line, the line a frame was on when the profiler started)."""
    import linecache

    code = linecache.getline(frame.file, frame.line).strip() if frame.file else ""
    note = ""
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
    acc: dict[tuple[str, int, bool], list[Any]] = {}
    w = np.ones(len(rows)) if weights is None else np.asarray(weights, dtype=np.float64)
    for r, x in zip(rows, w):
        f = trace.user_frame(int(r))
        if f is None:
            continue
        key = (f.file, f.line, isinstance(f, StartedFrame))
        slot = acc.setdefault(key, [f, 0, 0.0])
        slot[1] += 1
        slot[2] += float(x)
    out = sorted(((f, n, s) for f, n, s in acc.values()), key=lambda t: (-t[2], -t[1]))
    return out[:limit]
