"""The profiler window's memory bound: what the audit adds to the process must not threaten the machine.

torch.profiler with shapes, stacks and memory keeps every event of the window in the process until
the window ends, and ending it (its result and export) costs more again: a program of many small
calls a step can grow by gigabytes a step in its profiled steps.

The bound: the window may add at most `--profile-memory` GiB (default: half the memory available
when it starts) to the process's resident memory then, its end included; its compressed trace at
most `--trace-size` MB. The window's warm-up step is a throwaway recording, stopped and exported as
the end is, which measures a step's recording and end (`step_cost`) and its trace (`step_trace`);
the window records the steps that fit at that cost (times STEP_MARGIN). Without a measured step,
resident memory is read at each backward pass's start, each step's end and by a watch between them
(auditor.capture.window_watch), and the recording ends where what it holds plus the largest growth
between two reads (`stride`), times UNCALIBRATED_FACTOR, would no longer fit. Where the planned
steps do not fit, the window records without shapes, and where not one fits, without stacks too
(`drops`). The cut says what bound would record the step whole (`need`).
The measurements behind these factors: bench/HISTORY.md, "auditor/capture/window_memory.py".
"""
from __future__ import annotations

import threading

import psutil

from auditor.command_options import MAX_TRACE_MB
from auditor.evidence.model import WindowCut, WindowDrop

GiB = 1 << 30
MB = 10**6
TRACE_SIZE_MB = 256.0  # the default bound of the kept trace, compressed
# an end's peak growth over its recording's growth (the resident memory's, read at a step's end):
# the largest measured, what a calibration's own recording is guarded by and a calibrated factor
# bounded by (time_sequence_prediction: 2.3-2.7 at the example's size, where training dominates;
# 8-16 at the tests' size, --length 10 --future 300, where its prediction under no_grad, many small
# ops freeing what they allocate, dominates a recording of 20-60 MB)
END_FACTOR = 16.0
# the factor a window with no whole step measured (a run of 2-3 steps: no step before its window) is
# predicted by: the largest measured, as its end may be of any mix of work. 4 (the 2.3-2.7 measured
# where a recording reaches gigabytes) let the tests' size pass a 0.22 GiB bound by 15%: it recorded
# the whole of step 0, its prediction under no_grad included, whose end costs 8-16 times its
# growth. The watch (auditor.capture.window_watch) stops such a window between its reads, where its
# growth times this reaches the bound: part of a step is kept where only reads at backward passes
# had none (a 1000-sample sequence grows 0.72 GB before its first read, 16 times that over a 9.4 GB
# bound).
UNCALIBRATED_FACTOR = END_FACTOR
TRACE_RATIO = 0.06  # compressed trace bytes per byte the recording grew where none was measured (0.024 measured)
CALIBRATION_MIN = 4 << 20  # a calibration that grew less than this measures noise: the defaults stay
FACTOR_RANGE = (1.5, END_FACTOR)
# a window's step costs up to this much more than its calibration's did (time_sequence_prediction:
# 0.26 GB and 3.5 MB of trace a step in the window, 0.20 GB and 2.6 MB in its calibration)
STEP_MARGIN = 1.4
# what the window drops, in turn, where its planned steps do not fit with everything recorded: what
# costs most first (time_sequence_prediction at the tests' size, a step's recording and end: 180 MB
# with both, 100 MB without shapes, 157 MB without stacks, 77 MB without either)
DROP_ORDER = ("record_shapes", "with_stack")


def allowed_growth(available: int, gib: float | None = None) -> int:
    """Bytes the window may add: the user's bound (`gib`, --profile-memory), else half of what was available."""
    return int(gib * GiB) if gib else available // 2


def trace_limit(mb: float | None = None) -> int:
    """Bytes the kept (compressed) trace may take: the user's bound (`mb`, --trace-size), else TRACE_SIZE_MB."""
    return int((mb if mb and 0 < mb <= MAX_TRACE_MB else TRACE_SIZE_MB) * MB)  # (inf, nan: the default)


def release_freed() -> None:
    """Return the heap memory a window's end freed to the system (glibc's malloc_trim): its
    result, once dropped, otherwise stays resident for the rest of the run."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_rss() -> int:
    """The process's peak resident memory so far (VmHWM), 0 where unknown."""
    return _status_bytes("/proc/self/status", "VmHWM:")


class Guard:
    """The window's memory and trace bounds, read at each point the window may end (a backward pass
    starting, a step ending: ~2 us a read) while the window records."""

    def __init__(self, memory_gib: float | None = None, trace_mb: float | None = None) -> None:
        from auditor.capture.session import rss_bytes  # (the child's: the parent imports no torch)

        self._rss = rss_bytes
        self.start_rss = rss_bytes() or 0
        self.bound = allowed_growth(psutil.virtual_memory().available, memory_gib)
        self.trace_bound = trace_limit(trace_mb)
        self.factor = UNCALIBRATED_FACTOR
        self.trace_ratio = TRACE_RATIO
        self.calibrated_on: int | None = None  # the step whose whole recording and end were measured
        self.calibration_cut = False  # the calibration's recording was cut short (no whole step measured)
        self.step_cost = 0  # that step's recording and end: the peak's growth over its start
        self.step_trace = 0  # that step's trace, compressed
        self.peak = self.start_rss
        self.rec_start = self.last = self.start_rss
        self.stride = 0  # the largest growth between two reads while recording
        self.reason = "memory"
        self.dropped: tuple[str, ...] = ()  # what the window records without (DROP_ORDER)

    def read(self) -> int:
        """The process's resident memory now (0 where unknown)."""
        return self._rss() or 0

    @property
    def reads_decide(self) -> bool:
        """Whether the window's reads (each backward pass's start, each step's end, the watch)
        decide where it ends: no whole step measured, or one measured with what it dropped."""
        return self.calibrated_on is None or bool(self.dropped)

    def drops(self, planned: int) -> WindowDrop | None:
        """What the window drops to record its `planned` steps (None: nothing): where they do not all
        fit at the calibrated step's cost, shapes; where not one does, stacks as well."""
        if self.calibrated_on is None:
            return None
        fitted = self.steps_allowed(planned)
        if fitted >= planned:
            return None
        self.dropped = DROP_ORDER[:1] if fitted >= 1 else DROP_ORDER
        return WindowDrop(dropped=list(self.dropped), calibrated_on=self.calibrated_on, step_cost_bytes=self.step_cost,
                          step_trace_bytes=self.step_trace, fitted=fitted, planned=planned, reason=self.reason,
                          start_rss_bytes=self.start_rss, limit_bytes=self.start_rss + self.bound,
                          trace_limit_bytes=self.trace_bound)

    def watch_limit(self, calibrating: bool) -> int:
        """The resident memory past which the watch stops the recording: the calibration's, whose
        end END_FACTOR predicts; else `limit`."""
        if calibrating:
            return int(self.rec_start + self.room() / END_FACTOR)
        return self.limit()

    def begin(self) -> None:
        """The recording starts (again) here."""
        self.rec_start = self.last = self._rss() or 0
        self.peak = max(self.peak, self.rec_start)

    def room(self) -> int:
        """What the window may still add, from where the recording starts."""
        return self.start_rss + self.bound - self.rec_start

    def calibration_fits(self) -> bool:
        """Whether the calibration's recording may go on to the next read: its end, predicted by
        END_FACTOR, fits the bound. Reads the memory."""
        rss = self._rss() or 0
        self.stride = max(self.stride, rss - self.last)
        self.last = rss
        return (rss + self.stride - self.rec_start) * END_FACTOR <= self.room()

    def calibrate(self, step: int | None, stop_rss: int, end_peak: int, trace_bytes: int) -> None:
        """An end measured: the recording grew from rec_start to stop_rss, its end peaked at
        end_peak, its trace took trace_bytes compressed. `step`: the step it recorded whole (None:
        part of one, which measures the factor only)."""
        grown = stop_rss - self.rec_start
        self.peak = max(self.peak, end_peak)
        self.calibration_cut = step is None
        if step is not None:
            self.calibrated_on = step
            self.step_cost = max(end_peak - self.rec_start, 1)
            self.step_trace = max(trace_bytes, 1)
        if grown < CALIBRATION_MIN:
            return
        self.trace_ratio = max(trace_bytes / grown, 1e-4)
        measured = (end_peak - self.rec_start) / grown
        if step is None:  # (part of a step measures its own mix of work, not the step's: it only raises the factor)
            measured = max(measured, self.factor)
        self.factor = min(max(measured, FACTOR_RANGE[0]), FACTOR_RANGE[1])

    def steps_allowed(self, planned: int) -> int:
        """How many whole steps the window may record: each costs what the calibration's step did
        (its recording and end), within the bound and the trace's bound. `planned` where no whole
        step was measured (the reads decide)."""
        if self.calibrated_on is None:
            return planned
        by_memory = self.room() // (self.step_cost * STEP_MARGIN)
        by_trace = self.trace_bound // (self.step_trace * STEP_MARGIN)
        self.reason = "memory" if by_memory <= by_trace else "trace-size"
        return int(max(0, min(planned, by_memory, by_trace)))

    def limit(self) -> int:
        """The resident memory the recording may reach: its end, `factor` times what it grew,
        within the bound, and its trace within the trace's bound."""
        by_memory = self.rec_start + self.room() / self.factor
        by_trace = self.rec_start + self.trace_bound / self.trace_ratio
        self.reason = "memory" if by_memory <= by_trace else "trace-size"
        return int(min(by_memory, by_trace))

    def fits(self) -> bool:
        """Whether the recording may go on to the next read: what it holds now and the largest
        stride seen fit its limit. Reads the memory."""
        rss = self._rss() or 0
        self.peak = max(self.peak, rss)
        self.stride = max(self.stride, rss - self.last)
        self.last = rss
        return rss + self.stride <= self.limit()

    def need(self) -> int:
        """The bound (bytes over the window's start) that would record the step the window stopped
        in whole, as estimated from what was measured: a calibrated step's recording and end (times
        STEP_MARGIN) over where its recording started; with none, what was recorded until the stop
        times `factor`, a lower estimate (the step's rest was not recorded)."""
        if self.calibrated_on is not None:
            return int(self.rec_start - self.start_rss + self.step_cost * STEP_MARGIN)
        return int(self.rec_start - self.start_rss + max(self.last - self.rec_start, 0) * self.factor)

    def cut(self, step: int, nothing: bool = False, planned: int = 0) -> WindowCut:
        return WindowCut(need_bytes=self.need(), step=step, rss_bytes=self.last, start_rss_bytes=self.start_rss,
                         limit_bytes=self.start_rss + self.bound, reason=self.reason, nothing=nothing,
                         factor=round(self.factor, 3), calibrated_on=self.calibrated_on,
                         stride_bytes=self.stride, trace_limit_bytes=self.trace_bound,
                         step_cost_bytes=self.step_cost, step_trace_bytes=self.step_trace, planned=planned,
                         warm_up_cut=self.calibration_cut and self.calibrated_on is None)


class ChildMemory:
    """The audited process's resident memory, sampled by the parent while it runs: what a kill by
    the kernel's out-of-memory killer leaves as evidence (the child cannot report its own SIGKILL)."""

    def __init__(self, pid: int, every_s: float = 0.25) -> None:
        self.peak = self.last = 0
        self.hwm = 0  # the kernel's count of its peak (VmHWM): what no sampling between two reads misses
        self._status = f"/proc/{pid}/status"
        self.available = self.total = 0
        self._done = threading.Event()
        try:
            self._process: psutil.Process | None = psutil.Process(pid)
        except psutil.Error:
            self._process = None
            return
        self._every = every_s
        threading.Thread(target=self._sample, name="auditor-child-memory", daemon=True).start()

    def _sample(self) -> None:
        while True:
            try:
                rss = self._process.memory_info().rss
                vm = psutil.virtual_memory()
            except psutil.Error:
                return
            if rss:  # (a killed process not yet reaped reads 0: its last sample stays the evidence)
                self.last, self.peak = rss, max(self.peak, rss)
                self.available, self.total = vm.available, vm.total
                self.hwm = max(self.hwm, _status_bytes(self._status, "VmHWM:"))
            if self._done.wait(self._every):
                return

    def stop(self) -> None:
        self._done.set()

    def peak_bytes(self) -> int:
        """The child's peak resident memory as read from outside: the kernel's own count where it
        could be read, else the largest sample."""
        return max(self.hwm, self.peak)


def _status_bytes(path: str, key: str) -> int:
    """A `kB` field of a /proc/PID/status file, in bytes; 0 where unreadable."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def cgroup_limit() -> int | None:
    """The memory limit of this process's cgroup (a container's), if it has one."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < (1 << 60):
            return int(text)
    return None


def out_of_memory_kill(peak: int, last: int, available: int, total: int, limit: int | None) -> str | None:
    """Why a SIGKILL that nobody in the audit sent is the kernel's out-of-memory killer's, or None:
    at the last sample the machine had under a tenth of its memory available, or the process held
    nine tenths of its cgroup's limit, or half the machine."""
    if not last:
        return None
    if limit and peak >= 0.9 * limit:
        return f"it held {peak / 1e9:.1f} GB of its container's {limit / 1e9:.1f} GB limit"
    if total and available < 0.1 * total:
        return f"the machine had {available / 1e9:.1f} GB of {total / 1e9:.1f} GB left"
    if total and peak >= 0.5 * total:
        return f"it held {peak / 1e9:.1f} GB of the machine's {total / 1e9:.1f} GB"
    return None
