"""The parsed profiler trace (Trace): metadata, a columnar events frame, flows and the symbol
table, with the queries on them that every rule shares (selection by category and name, the
auditor's own ranges, the operator table, steps and windows, the enclosing calls and Python frames
of a row). auditor.evidence.trace.load builds it from a file."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from auditor.evidence.frame import Frame
from auditor.evidence.recorded_frames import is_library_file, parse_frame
from auditor.evidence.trace.arg_records import ArgRecord
from auditor.evidence.trace.call_lines import call_line, callee_name, started_call_line
from auditor.evidence.trace.decode import CAT, CPU_NESTING, GPU_SIDE, GPU_WORK, SymbolTable
from auditor.evidence.trace.intervals import merge_intervals
from auditor.evidence import source_access

if TYPE_CHECKING:  # (pandas is imported where a trace is read: an audit without one never pays for it)
    import pandas as pd

# record_function ranges the auditor runs its own work in (e.g. `auditor::numerics` around the
# numerics collector's checks): every operator inside one was the audit's, not the program's
AUDITOR_RANGE = re.compile(r"^auditor::")
# The profiler's Python tracer records the frames already running when it starts within
# microseconds of its first event (Trace.startup_frames); later calls come after its own start-up.
STARTUP_WINDOW_US = 1000.0
_TORCH_VERSION_KEY = re.compile(r"^(?:py)?torch[_ ]?version$", re.IGNORECASE)
_VERSION = re.compile(r"^\d+\.\d+(?:\.\d+)?(?:[-+.\w]*)$")


def empty_steps() -> pd.DataFrame:
    """A steps frame with no steps (Trace.steps' columns)."""
    import pandas as pd
    return pd.DataFrame({"step": np.empty(0, dtype=np.int64), "row": np.empty(0, dtype=np.int64),
                         "ts": np.empty(0, dtype=np.float64), "end": np.empty(0, dtype=np.float64),
                         "dur": np.empty(0, dtype=np.float64)})


# ---------------------------------------------------------------------------------------------
@dataclass
class Trace:
    """One parsed profiler trace: metadata, an events frame, flows, and the symbol table.

    `events` columns: cat (index into CATEGORIES), raw_cat and name (symbol codes), instant, pid,
    tid (ints; "stream 7" -> 7), ts/dur/end (microseconds). From args, -1 when absent and read
    only where a rule uses them: external_id and correlation (launch calls and GPU rows), bytes,
    stream, device (GPU rows; bytes also for `[memory]`), total_allocated and device_type
    (`[memory]`), stack (symbol of the old-schema `Call stack` of operators), sync_kind (symbol,
    `cuda_sync` rows), args (operators: the index of their argument record in `arg_records`, -1
    when none; auditor.evidence.trace.arg_records). Derived once at load: parent (row of the enclosing host event on the same
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
    workers: int = 0  # processes that decoded it (auditor.evidence.trace.parallel), 0 when this one did
    # Events left out because a field they need had a value of the wrong type, said as a sentence
    # (empty: none): the report says so, since what they held is missing from every number.
    dropped: str = ""
    # How messages name it: its file name, or its path in the TensorBoard logdir it was found in
    # (`run-a/host.pt.trace.json`: a logdir's runs often share file names; set by evidence.load).
    label: str = ""
    # The CPU-side steps, in time order: columns step (number), row (of its ProfilerStep range, -1
    # for steps taken from the optimizer's), ts, end, dur (us). Found by the loader
    # (auditor.evidence.trace.steps.find_steps): the ProfilerSteps, or for a trace without them the
    # iterations its optimizer's steps delimit (empty when fewer than two can be told).
    steps: pd.DataFrame = field(default_factory=lambda: empty_steps())
    # How the steps were taken when the trace has no ProfilerSteps, in the words that follow 'its N
    # steps' (`are taken from the end of one Optimizer.step#SGD.step to the end of the next`); None
    # otherwise.
    steps_from: str | None = None
    # The distinct argument records of the operators (input dims, types, strides, concrete inputs),
    # indexed by the `args` column.
    arg_records: list[ArgRecord] = field(default_factory=list)

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

    def arg_record(self, row: int) -> ArgRecord | None:
        """The argument record of an operator row (None: it records none)."""
        if "args" not in self.events:
            return None
        code = int(self.col("args")[row])
        return self.arg_records[code] if code >= 0 else None

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
    def of(self, *categories: str, columns: list[str] | None = None) -> pd.DataFrame:
        """Rows of the given normalised categories (see CATEGORIES); only `columns` of them, when
        given (the others are not copied)."""
        rows = np.isin(self.col("cat"), [CAT[c] for c in categories])
        return self.events.loc[rows, columns] if columns is not None else self.events[rows]

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
        # per name code (a few thousand, dense; -1 for none): counted in one pass, no sort of the operators
        slot = name[ops].astype(np.int64) + 1
        count = np.bincount(slot)
        self_us = np.bincount(slot, weights=np.maximum(dur[ops] - inner[ops], 0.0))
        total_us = np.bincount(slot, weights=dur[ops])
        used = np.flatnonzero(count)  # (the names operators have, in code order, as np.unique gave them)
        codes, count, self_us, total_us = used - 1, count[used], self_us[used], total_us[used]
        order = np.argsort(-self_us, kind="stable")[:limit]
        return [{"name": self.symbols[int(codes[i])], "count": int(count[i]), "self_ms": float(self_us[i]) / 1e3,
                 "total_ms": float(total_us[i]) / 1e3} for i in order]

    # -- steps and windows ---------------------------------------------------------------------
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
        """Median step in ms (the whole window when there are no steps), each step on its bound's
        clock (step_times_ms): what a cost found in this trace is a share of, as the report's
        median step is for a run."""
        if not len(self.steps):
            return self.step_ms()
        return float(np.median(self.step_times_ms()))

    def host_step_ms(self) -> np.ndarray:
        """Each step's span on the host (its ProfilerStep, or its iteration), in ms."""
        return self.steps["dur"].to_numpy(dtype=np.float64) / 1000.0

    def device_step_ms(self) -> np.ndarray:
        """Each step's time on the device, in ms: the kernels, copies and memsets merged across
        streams inside the step's host span (its ProfilerStep on the CPU, not the GPU-side range,
        which begins where the device reached the step's first work), or, where more, those its
        launches made (a host that queues a GPU-bound step in 2 ms keeps the device busy for 60,
        after the span). Their busy time, not their span: in a device-bound recording a step's
        kernels run after the backlog queued before it, and a span from its first kernel to its
        last can cover other steps' work. NaN for a step with neither."""
        cached = self.__dict__.get("_device_step_ms")
        if cached is not None:
            return cached
        out = np.full(len(self.steps), np.nan)
        if len(self.steps):
            step = self.col("step")
            rows, ts, end = self.launched_work()
            which = {int(n): k for k, n in enumerate(self.steps["step"].to_numpy())}
            for n in np.unique(step[rows]):
                k = which.get(int(n))
                if k is not None:
                    sel = step[rows] == n
                    lo, hi = merge_intervals(ts[sel], end[sel])
                    out[k] = float((hi - lo).sum()) / 1000.0
            inside = self._busy_in_steps()
            out = np.fmax(out, np.where(inside > 0, inside, np.nan))  # (the larger of the two; NaN: neither)
        self.__dict__["_device_step_ms"] = out
        return out

    def _busy_in_steps(self) -> np.ndarray:
        """Each step's device busy time inside its host span (ms): every kernel, copy and memset,
        whoever launched it, merged across streams and clipped to the span."""
        cat, ts, end = self.col("cat"), self.col("ts"), self.col("end")
        gpu = np.isin(cat, GPU_WORK) & np.isfinite(ts) & np.isfinite(end)
        lo, hi = merge_intervals(ts[gpu], end[gpu])
        out = np.zeros(len(self.steps))
        if not len(lo):
            return out
        covered = np.r_[0.0, np.cumsum(hi - lo)]  # busy time before each merged interval

        def busy_until(t: np.ndarray) -> np.ndarray:
            k = np.searchsorted(lo, t, side="right")  # intervals begun by t
            partial = np.clip(t - lo[np.maximum(k - 1, 0)], 0.0, (hi - lo)[np.maximum(k - 1, 0)])
            return covered[np.maximum(k - 1, 0)] + np.where(k > 0, partial, 0.0)

        s_ts, s_end = self.steps["ts"].to_numpy(dtype=np.float64), self.steps["end"].to_numpy(dtype=np.float64)
        return (busy_until(s_end) - busy_until(s_ts)) / 1000.0

    def launched_work(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, ts, end) of the kernels, copies and memsets the steps' launches made, with finite
        times. Only work whose launch the trace holds: a kernel of the backlog queued before the
        window has none, and the time it ran at says nothing of which step queued it."""
        rows = np.flatnonzero(np.isin(self.col("cat"), GPU_WORK) & (self.col("step") >= 0) & (self.col("link") >= 0))
        ts, end = self.col("ts")[rows], self.col("end")[rows]
        ok = np.isfinite(ts) & np.isfinite(end)
        return rows[ok], ts[ok], end[ok]

    def step_times_ms(self) -> np.ndarray:
        """Each step on its bound's clock: the longer of its host and device spans (ms)."""
        host = self.host_step_ms()
        device = self.device_step_ms()
        return np.where(np.isfinite(device) & (device > host), device, host)

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
        earliest call inside each, down to the profiler's own start on the thread that started
        it: through library frames between the user's (a launcher's `runpy.run_path` above the
        program's module code, an optimizer's step running the hook that called `prof.step()`)."""
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
                r = root
                while r in first_child or r == root:
                    child = first_child.get(r)
                    if child is None:
                        break
                    out[r] = child
                    r = child
        self.__dict__["_startup_frames"] = out
        return out

    def _program_frame(self, code: int) -> Frame | None:
        """The frame a Python event's name (symbol `code`) names when it is the program's, not a
        library's; each name is read once per trace."""
        cache: dict[int, Frame | None] = self.__dict__.setdefault("_program_frames", {})
        if code not in cache:
            f = parse_frame(self.symbols[code])
            cache[code] = f if f is not None and not is_library_file(f.file) else None
        return cache[code]

    def _called(self, path: list[int], begin: float) -> int:
        """What the frame at the end of `path` (a walk up from a row that began at `begin`) was
        calling then: the outermost row of the walk below it still running at `begin` (a call that
        had returned is not running the row: `prof.step()`, under which a ProfilerStep range
        hangs), ProfilerStep ranges left out; -1 when the walk holds no row below the frame."""
        ends = self.col("end")
        for r in reversed(path[:-1]):
            if ends[r] >= begin and not self.name(r).startswith("ProfilerStep#"):
                return r
        return path[0] if len(path) > 1 else -1

    def user_frame(self, row: int) -> Frame | None:
        """The innermost frame outside torch, the standard library and site-packages.

        Memoised per row: every row on a walked chain gets the answer, so attributing thousands
        of kernels costs one walk per distinct call site. A frame that was running when the
        profiler started names the line it was on then, which holds only for rows that began
        before the call it was making returned; later rows get started_frame's answer. That is
        judged on time, not on the chain: a ProfilerStep range opens inside `prof.step()` and
        outlives it, so the rows of every step hang below the call that started the profiler.
        """
        cat, link = self.col("cat"), self.col("link")
        if cat[row] in GPU_SIDE and link[row] >= 0:
            row = int(link[row])
        frame, early, _, below, _ = self._frame_walk(row)
        return self._frame_line(row, frame, early, below)

    def _frame_walk(self, row: int) -> tuple[Frame | None, int, int, int, float]:
        """user_frame's walk up from a host row, memoised: (the frame, its row in startup_frames when
        it ran before the profiler else -1, the frame's row, the row below it, until when the answer
        holds: the end of the frame's call or of the call it was making); -1 for rows unknown."""
        cache: dict[int, tuple[Frame | None, int, int, int, float]] = self.__dict__.setdefault("_user_frames", {})
        cat = self.col("cat")
        parent = self.col("parent")
        stack = self.col("stack")
        names = self.col("name")
        startup = self.startup_frames()
        path: list[int] = []
        found: tuple[Frame | None, int, int, int, float] = (None, -1, -1, -1, math.inf)
        # (read row by row: a walk reads a few of a million ends, and a list of them all cost more
        # than the walks of every rule together: 0.05-0.12 s and 40 MB on the 506 MB tiling)
        ends = self.col("end")
        begin = float(self.col("ts")[row])
        r = row
        while r >= 0:
            hit = cache.get(r)
            # (an answer whose frame, or the call it was making, had returned before this row began
            # is not this row's: rows below a `prof.step()` in an optimizer's hook begin after it)
            if hit is not None and hit[4] >= begin:
                found = hit
                if found[2] == r:  # the frame's own row: what it called is on the walk that came here
                    found = (*found[:3], self._called([*path, r], begin), found[4])
                break
            path.append(r)
            # a Python call that returned before the row began is not running it: a ProfilerStep
            # range opened by `prof.step()` in a launcher's optimizer hook hangs below the hook's
            # call, and the step's work is the program's, above the hook
            if cat[r] == CAT["python"] and ends[r] >= begin:
                f = self._program_frame(int(names[r]))
                if f is not None:
                    found = (f, r if r in startup else -1, r, self._called(path, begin), math.inf)
                    break
            elif stack[r] >= 0:
                for part in self.symbols[int(stack[r])].split(";"):
                    f = parse_frame(part)
                    if f is not None and not is_library_file(f.file):
                        found = (f, -1, -1, -1, math.inf)
                        break
                break
            r = int(parent[r])
            if len(path) > 10_000:  # a cycle cannot happen by construction; stay safe anyway
                break
        # rows above what the frame was calling (a ProfilerStep range, the `prof.step()` it hangs
        # under) are not cached: each row below them was calling something else of the frame's; nor
        # are rows that outlive the frame or that call (a ProfilerStep range a `prof.step()` in an
        # optimizer's hook opened): rows below them after it returned are not that call's
        if path:
            upto = path.index(found[3]) if found[3] in path else len(path)
            held = float(ends[found[2]]) if found[2] >= 0 else math.inf
            outlives = min(held, float(ends[found[3]]) if found[3] >= 0 else math.inf)
            answer = (*found[:4], outlives)
            for i, p in enumerate(path):
                if p == found[2]:
                    cache[p] = (*found[:3], -1, held)
                elif i <= upto and (outlives == math.inf or ends[p] <= outlives):
                    cache[p] = answer
        return found

    def _frame_line(self, row: int, frame: Frame | None, early: int, below: int) -> Frame | None:
        """The frame user_frame's walk found for `row`, named at the line of the call it was making
        (`below`, its row), or, for work a frame running since the profiler started did later,
        at the line of its function that can make that call."""
        names = self.col("name")
        startup = self.startup_frames()
        if frame is not None and below >= 0:
            # a trace names a Python frame by its def line: the line calling what ran below it
            # (worked out once per frame and name below it: it reads the function's source)
            at_line: dict[tuple[Frame, int], Frame] = self.__dict__.setdefault("_call_lines", {})
            key = (frame, int(names[below]))
            if key not in at_line:
                at_line[key] = call_line(frame, callee_name(self.symbols[key[1]]))
            frame = at_line[key]
        if frame is None or early < 0 or self.col("ts")[row] < self.col("end")[startup[early]]:
            return frame
        # work a frame running since the profiler started did later: at the line of its function
        # (or module) that can make what ran below it, the few that can, else the function itself
        moved: dict[tuple[Frame, int], Frame] = self.__dict__.setdefault("_started_frames", {})
        key = (frame, int(names[below]) if below >= 0 else -1)
        if key not in moved:
            callee = callee_name(self.symbols[key[1]]) if below >= 0 else None
            start = 0 if frame.function == "<module>" else _def_line(frame.file, frame.line, frame.function)
            moved[key] = started_call_line(frame, start, callee) or started_frame(frame)
        return moved[key]



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


def enclosing_def_line(frame: Frame) -> int | None:
    """The `def` line of the function `frame` is in (its own line when it names the def)."""
    if not frame.file:
        return None
    m = _DEF.match(source_access.getline(frame.file, frame.line))
    if m and m.group(2) == frame.function:
        return frame.line
    return _def_line(frame.file, frame.line, frame.function)


def _def_line(file: str, line: int, function: str) -> int | None:
    """The line of `def function` that encloses `line` in `file` (None for module code, or when
    the file cannot be read here)."""
    lines = source_access.getlines(file) if file else []
    if not (0 < line <= len(lines)) or not function.isidentifier():
        return None
    indent = len(lines[line - 1]) - len(lines[line - 1].lstrip())
    for n in range(line - 1, 0, -1):
        m = _DEF.match(lines[n - 1])
        if m and len(m.group(1)) < indent:  # the def whose body holds the line
            return n if m.group(2) == function else None
    return None

