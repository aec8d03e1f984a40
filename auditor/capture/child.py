"""The child process: installs probes, imports the target, calls the step N times (or runs a whole
program, auditor.capture.program), streams evidence.

Run by the parent as `python -m auditor.capture.child REQUEST` (REQUEST: a wire.ChildRequest, JSON).
Everything it learns goes to the parent at once over the pipe FD, so whatever ends this process
(an exception, Ctrl-C, an OOM, a segfault, a kill) the parent still has every step seen so far.
"""
from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import platform
import signal
import socket
import sys
import traceback
from typing import Any, Callable, Iterator, Sequence

import msgspec

# torch is imported before anything of the user's, and the probes go in before the target module runs.
import torch

from auditor.capture import (bench_switches, cuda_memory, cuda_standins, graphs, probes, rehearsal, torch_private,
                             window_memory, window_watch, wire)
from auditor.capture.trace_file import export_dir as _trace_dir, unsafe_for_trace as _unsafe_for_trace  # noqa: F401
from auditor.capture.collectors import load_collectors
from auditor.capture.exit_bound import bound_exit
from auditor.capture.frames import forget_codes, is_library
from auditor.capture.program import ChildParts, run_program
from auditor.capture.session import StepSession, new_loaders
from auditor.capture.stream import Writer
from auditor.capture.target import Target, TargetError, import_target, parse_target, step_arity
from auditor.capture.unseen import no_torch_function, programs_profiler, warnings_name_the_user
from auditor.capture.user_traceback import print_users_traceback
from auditor.evidence import model as m
from auditor.evidence.frame import Frame

ENV_PREFIXES = ("PYTORCH_", "TORCH_", "CUDA_", "NCCL_", "OMP_", "MKL_", "CUBLAS_", "CUDNN_", "KINETO_")
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD")
# CUDA's "CUDA out of memory", the CPU allocator's "DefaultCPUAllocator: can't allocate memory",
# MPS/XPU's "out of memory" variants.
OOM_MESSAGES = ("out of memory", "can't allocate memory", "not enough memory")

def environment(standins: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k.startswith(ENV_PREFIXES) and not any(w in k for w in SECRET_WORDS)}
    notes = []
    if standins:
        notes.append("No CUDA device here: calls to the torch.cuda memory-statistics family "
                     f"({', '.join(sorted(standins))}) were recorded and answered as an idle device would "
                     "(zeros, empty stats) instead of raising.")
    cuda = torch.cuda.is_available()  # (in a rehearsal the auditor's own calls get the true answer: False)
    return {
        "torch_version": str(torch.__version__),
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "device": "cuda" if cuda else "cpu",
        "cuda_available": cuda,
        "cuda_standins": bool(standins),
        "num_threads": torch.get_num_threads(),
        "env_vars": env,
        "notes": notes,
    }


def cuda_devices() -> list[dict]:
    """Each visible device's memory, for oom-risk's capacity (else it must assume one): read when
    the run ends, and only if the program itself initialised CUDA. Reading device properties
    initialises CUDA, and doing that before the program runs would change it: a
    CUDA_VISIBLE_DEVICES it sets at import would be ignored, and forked DataLoader workers could
    no longer use CUDA. A failure here is never the run's."""
    try:
        if not torch.cuda.is_initialized():
            return []
        return [{"index": i, "name": str(p.name), "total_memory": int(p.total_memory),
                 "memory_fraction": _memory_fraction(i)}
                for i in range(torch.cuda.device_count()) for p in (torch.cuda.get_device_properties(i),)]
    except Exception:
        return []


def _memory_fraction(index: int) -> float:
    """The share of the device's memory the caching allocator may use in this process
    (torch.cuda.set_per_process_memory_fraction; 1.0 unset or unknown to this torch)."""
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    try:
        return float(get(index)) if get is not None else 1.0
    except Exception:
        return 1.0


def _default_device() -> str:
    """What `torch.set_default_device` (or a `with torch.device(...)`) set, as the device-context
    mode on the stack holds it: `torch.get_default_device()` learns an index by making a tensor
    through every mode on the stack, the user's too."""
    from torch.utils import _device

    device = getattr(_device, "CURRENT_DEVICE", None)
    return str(device) if device is not None else "cpu"


_FLAGS: dict[str, Callable[[], Any]] = {
    "cudnn.benchmark": lambda: torch.backends.cudnn.benchmark,
    "cudnn.deterministic": lambda: torch.backends.cudnn.deterministic,
    "cuda.matmul.allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
    "float32_matmul_precision": torch.get_float32_matmul_precision,
    "deterministic_algorithms": torch.are_deterministic_algorithms_enabled,
    "anomaly_enabled": torch.is_anomaly_enabled,
    "grad_enabled": torch.is_grad_enabled,
    "default_device": _default_device,
}


def backend_flags() -> dict:
    """The program's backend settings, read after its setup and at its end. The reads run with
    torch-function dispatch off: a mode the program entered at import is still on the stack, and
    must neither see them nor fail them (a mode that refuses the call must not turn a failed setup's
    own error into a traceback of the auditor's). A read that fails is left out."""
    flags = {}
    with no_torch_function():
        for name, read in _FLAGS.items():
            try:
                flags[name] = read()
            except Exception:
                pass
    return flags


def profile_plan(steps: int) -> tuple[int | None, list[int]]:
    """(warm-up step, active steps) of the profiler window: a few steps after the first ones,
    so compile/allocator warm-up stays out and the profiler's overhead stays off most steps."""
    active_n = 3 if steps >= 10 else 2 if steps >= 5 else 1
    first = min(4, steps // 4)
    if first + active_n > steps:
        first = max(0, steps - active_n)
    warm = first - 1 if first >= 1 else None
    return warm, list(range(first, first + active_n))


def graph_scan_points(steps: int, window: Sequence[int] = ()) -> set[int]:
    """Step boundaries after which the graph-leak scan runs (a full one costs 50-200 ms): after steps
    1, 4, 16, 64, ... (powers of 4: a run killed early is scanned twice before it ends, a 50-step
    audit 5 times), the middle (a power of 4 in the run's middle third serves: graph-leak judges
    its trend over the first, middle and last, _support.scans.spread_scans) and the last; a step
    that raises is scanned too (_failure_scan). None while the profiler records (`window`, warm-up
    first: a scan there would be the program's host time in its trace): such a point runs after
    the window's last step when a scan comes before the window, else just before it; a window
    that begins at step 0 begins with its calibration, after which the point runs (a 5-step run
    scans after 0, 2 and 4)."""
    if steps <= 3:
        points = set(range(steps))
    else:
        points = {4 ** k for k in range(steps.bit_length()) if 4 ** k < steps} | {steps - 1}
        if not [p for p in points if steps / 3 <= p <= 2 * steps / 3 and 1 < p < steps - 1]:
            points.add(steps // 2)
    if not window:
        return points
    inside = {p for p in points if window[0] <= p < window[-1]}
    if not inside:
        return points
    if window[0] == 0:  # (its first step is the calibration's: scanned after it)
        return (points - inside) | {0}
    return (points - inside) | {window[-1] if min(points) < window[0] else window[0] - 1}


class Terminated(KeyboardInterrupt):
    """SIGTERM (a job scheduler's stop, `kill`): ends the run as an interrupt does, with a report.
    A KeyboardInterrupt, so that it takes the same path as Ctrl-C through the user's code and ours."""


def die_with_parent(parent_pid: int) -> None:
    """An `audit` killed outright (SIGKILL, a closed terminal) must not leave its child running the
    user's training unseen, with nobody to report to: ask Linux to kill the child with its parent."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before that took effect, or a wrapper runs python
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(3)
        except OSError:
            pass


def _package_hint(t: Target) -> str:
    """A file that uses relative imports is a module of its package, as with `python -m`: name it so."""
    if t.file is None:
        return ""
    parts = [t.module]
    d = os.path.dirname(t.file)
    while os.path.isfile(os.path.join(d, "__init__.py")):
        parts.insert(0, os.path.basename(d))
        d = os.path.dirname(d)
    if len(parts) == 1:
        return ""
    return (f" (it uses relative imports, so it is part of package {parts[0]!r}: audit it as a module, "
            f"from {d}: audit run {'.'.join(parts)}:{t.attr})")


def _frame_of_exception(exc: BaseException) -> Frame | None:
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno and not is_library(exc.filename):
        return Frame(file=exc.filename, line=exc.lineno)  # (the bad line: in no frame)
    for fs in reversed(traceback.extract_tb(exc.__traceback__)):
        if not is_library(fs.filename):
            return Frame(file=fs.filename, line=fs.lineno, function=fs.name)
    return None


def exception_text(exc: BaseException) -> str:
    """`str(exc)` as Python's traceback printer shows it: an exception whose `__str__` raises or
    returns something other than a string is shown as `<exception str() failed>`."""
    try:
        text = str(exc)
    except BaseException:
        return "<exception str() failed>"
    return text if isinstance(text, str) else "<exception str() failed>"


def echo_exit_message(exc: BaseException) -> None:
    """`sys.exit("message")`: Python prints the message on stderr as the program ends."""
    if isinstance(exc, SystemExit) and exc.code is not None and not isinstance(exc.code, int):
        try:
            print(exc.code, file=sys.stderr, flush=True)
        except Exception:
            pass


def _ending(exc: BaseException, step: int | None, devices: list[dict] | None = None) -> wire.Ended:
    text = exception_text(exc)
    if isinstance(exc, KeyboardInterrupt):
        status = "interrupted"
    elif isinstance(exc, SystemExit) and exc.code in (0, None):
        status = "exited"  # sys.exit(0) / exit(): the program stopped itself, not a failure
    elif isinstance(exc, SystemExit):
        status = "raised"
    elif isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" or any(
            s in text for s in OOM_MESSAGES):
        status = "oom"
    else:
        status = "raised"
    message = text[:2000]
    if status == "interrupted" and not message and SIGNALS_SEEN:  # (a bare KeyboardInterrupt: its signal)
        message = f"stopped by {SIGNALS_SEEN[0]}"
    if status == "exited":
        message = f"the program stopped itself (sys.exit({exc.code!r})), as it would without the audit"
    elif isinstance(exc, SystemExit):
        code = exc.code if isinstance(exc.code, int) else 1
        message = f"the program exited with code {code} (sys.exit({exc.code!r}))"
    return wire.Ended(status=status, step=step, exception=type(exc).__name__, message=message,
                      traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-20000:],
                      where=_frame_of_exception(exc), cuda_devices=devices or [], audit_cause=_audit_cause(exc))


def _audit_cause(exc: BaseException) -> str | None:
    """Whether the audit's CUDA rehearsal, not the program, raised `exc` (rehearsal.blame)."""
    if not probes.judged_as_gpu_code():  # (no rehearsal: nothing of its is imported, under whatever mode raised)
        return None
    from auditor.capture.rehearsal.blame import audit_cause

    return audit_cause(exc)


ADDED_ENV: dict[str, str] = {}  # the parent's variables for torch's logging, removed from os.environ (see main)


def _start_profiler(prof) -> None:
    """Start the profiler with the parent's logging variables in the environment (Kineto reads
    its log level when it first starts), and without them again after."""
    os.environ.update(ADDED_ENV)
    try:
        _start_without_inductor(prof)
    finally:
        for name in ADDED_ENV:
            os.environ.pop(name, None)


def _start_without_inductor(prof) -> None:
    """Start torch.profiler without importing torch._inductor. Its prepare_trace reads one inductor
    flag (cudagraphs) behind `hasattr(torch, "_inductor")`, and that imports inductor and dynamo:
    1.6 s here, a third of a short audit of a step without a torch optimizer (creating one imports
    both anyway). The flag only matters where inductor runs, and there it is imported already;
    elsewhere it is read as absent for the duration of the start only."""
    if "torch._inductor" in sys.modules:
        prof.start()
        return
    lazy = torch.__dict__.get("__getattr__")

    def no_inductor(name: str):
        if name == "_inductor":
            raise AttributeError(name)
        return lazy(name)

    if lazy is not None:
        torch.__getattr__ = no_inductor
    try:
        prof.start()
    finally:
        if lazy is not None:
            torch.__getattr__ = lazy


def _no_cycle_warning() -> None:
    """torch.profiler warns once per process, on the user's stderr, when a profile prepares a second
    cycle without acc_events (on a CUDA run the window's start does): the window is one cycle, so
    nothing is lost, and the warning is marked as shown in torch's own once-only registry. (acc_events
    itself would parse every event into Python objects when the window stops: seconds, and a
    UnicodeDecodeError on some recorded names.)"""
    torch_private.mark_profiler_warnings_shown()


def window_schedule(warmup: int, active: int) -> Callable[[int], Any]:
    """The profiler's schedule for one window: `torch.profiler.schedule(wait=0, warmup=warmup,
    active=active, repeat=1)`, without its warning for a window with no warm-up step (a run of 1-3
    steps has none to spare, by the plan: not something the user can act on). The warning is
    avoided, not silenced: changing the warnings filters makes Python forget every warning it has
    shown, and a warning in the user's step would print once more when the window starts."""
    from torch.profiler import ProfilerAction

    def action(step: int) -> Any:
        if step < warmup:
            return ProfilerAction.WARMUP
        if step < warmup + active - 1:
            return ProfilerAction.RECORD
        return ProfilerAction.RECORD_AND_SAVE if step == warmup + active - 1 else ProfilerAction.NONE

    return action


STEP_END = "step end"  # (Profiler._bound's reads: the others are backward passes starting)


class Profiler:
    """torch.profiler over the planned window only; its trace goes to DIR/tb/<run>/ for TensorBoard,
    compressed (auditor.capture.trace_file).

    The window's bounds (auditor.capture.window_memory): the window's warm-up step is its
    calibration, a throwaway recording of the whole step (cut short where its own end could pass
    the bound), stopped and exported as the window's end is, which measures what a step's
    recording and end cost; the window then records as many of its active steps as fit its
    bounds at that cost (the profiler's warm-up is the calibration's), its memory read at each
    step's end, or, with no whole step measured, at each read until its bounds would be passed.
    A window whose planned steps do not all fit records without shapes, then stacks
    (window_memory.Guard.drops), and its reads decide. Where reads decide, and in the calibration,
    a watch reads between them too (auditor.capture.window_watch). A window whose first step does
    not fit its bounds keeps no trace."""

    def __init__(self, out_dir: str, run_name: str, steps: int, enabled: bool, memory_gib: float | None = None,
                 trace_mb: float | None = None) -> None:
        self.steps = steps  # the steps asked for (0: a program audited to its end)
        self.bounds = (memory_gib, trace_mb)  # --profile-memory, --trace-size (window_memory.Guard)
        self.warm, self.active = profile_plan(steps) if enabled and steps > 0 else (None, [])
        if bench_switches.WINDOW_AT and self.active:  # (bench_steady_parts.py --window-at only)
            at = bench_switches.WINDOW_AT
            self.warm, self.active = at - 1, [at + k for k in range(len(self.active))]
        self.start_at = self.warm if self.warm is not None else (self.active[0] if self.active else None)
        self.out_dir, self.run_name = out_dir, run_name
        self.written: list[str] = []  # the traces this window wrote (paths)
        self.unwritten = ""  # where the trace it could not write was to go (why: top_ops)
        self.notes: list[str] = []  # what the window did otherwise than asked, and why
        self.prof = None
        self.calibration = None  # the throwaway recording measuring an end (the warm-up step's)
        self.files: list[str] = []
        self.trace_bytes = 0
        self.snapshots: list[str] = []  # CUDA memory snapshots of the window, relative to the run dir
        self.top_ops: list[dict] = []
        self.guard: window_memory.Guard | None = None
        self.cut: m.WindowCut | None = None  # the window ended early to bound its memory
        self.drop: m.WindowDrop | None = None  # the window records without shapes or stacks to fit its bounds
        self._watch: window_watch.Watch | None = None
        self._busy = False  # in the audit's own window code: a watch's stop waits for the next read
        self._passed = False  # the watch saw the bound passed while busy
        self.step: int | None = None  # the step running
        self._unhook: Callable[[], None] | None = None
        self._keep = True  # whether the window's end writes its trace
        self.last = self.active[-1] if self.active else None  # the window's last step
        self.first_active = self.active[0] if self.active else None
        self._planned = frozenset(self.window())

    def window(self) -> list[int]:
        """The steps planned for the window."""
        return ([self.warm] if self.warm is not None else []) + self.active

    def profiled(self, i: int) -> bool:
        """Whether step i ran (wholly or in part) under the profiler."""
        return i in self._planned and (self.cut is None or i <= self.cut.step)

    def recorded_steps(self) -> list[int]:
        if self.cut is not None and self.cut.nothing:
            return []
        return [i for i in self.window() if self.profiled(i)]

    def _bound(self, what: str = "", tensors: Any = None) -> None:
        """End the calibration early, or the window, where going on could pass its bounds
        (window_memory): called on the program's own thread, at each backward pass's start and
        each step's end (`what` STEP_END). A window predicted by a calibrated whole step reads its
        memory at step ends only (a backward pass's start holds the step's activations, which the
        calibration's factor, measured at a step's end, does not count)."""
        with self._own():
            self._read(what)

    def _read(self, what: str) -> None:
        guard = self.guard
        if self.calibration is not None:
            if self._passed or not guard.calibration_fits():
                self._calibrated(whole=False)
            return
        if guard is None or self.prof is None or (not guard.reads_decide and what != STEP_END):
            return
        if self._passed or not guard.fits():
            self._end_early()

    def _end_early(self) -> None:
        """End the window in the step running: its bounds would be passed."""
        guard = self.guard
        step = self.step if self.step is not None else -1
        # (a window predicted by a calibrated step, cut at its first step's end, passed what it was
        # predicted by: none kept; a window its reads decide keeps what it recorded, part of its
        # first step included)
        first = bool(self.active) and step <= self.active[0] and not guard.reads_decide
        self.cut = guard.cut(step, nothing=first)
        self._keep = not first
        self.stop()

    def _watch_from(self, calibrating: bool) -> None:
        """Start the watch on what the recording started just now holds (window_watch)."""
        guard, self._passed = self.guard, False
        self._watch = window_watch.Watch(guard.read, lambda: guard.watch_limit(calibrating), self._watched)

    def _unwatch(self) -> None:
        """The recording ends: so does its watch."""
        self._passed = False
        if self._watch is not None:
            self._watch.stop()
            self._watch = None

    def _watched(self) -> None:
        """The watch saw the bound passed (on the main thread, at the program's next bytecode): end
        the calibration or the window here, or, inside the audit's own window code, at its next read."""
        self._watch = None
        if self._busy:
            self._passed = True
            return
        with self._own():
            self.guard.last = max(self.guard.last, self.guard.read())
            if self.calibration is not None:
                self._calibrated(whole=False)
            elif self.prof is not None:
                self._end_early()

    def _profile(self, schedule: Any = None, on_trace_ready: Any = None, dropped: Sequence[str] = ()) -> Any:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        return profile(activities=acts, record_shapes="record_shapes" not in dropped,
                       with_stack="with_stack" not in dropped and not programs_profiler(self.notes),
                       profile_memory=True, schedule=schedule, on_trace_ready=on_trace_ready)

    @contextlib.contextmanager
    def _own(self) -> Iterator[None]:
        """The audit's own window code runs: a watch's stop inside it waits for the next read."""
        was, self._busy = self._busy, True
        try:
            yield
        finally:
            self._busy = was

    def before(self, i: int) -> None:
        if i != self.start_at and i != self.warm and i != self.first_active:  # (most steps: nothing to do)
            self.step = i
            return
        with self._own():
            self._before(i)

    def _before(self, i: int) -> None:
        self.step = i
        if i == self.start_at:
            self.guard = window_memory.Guard(*self.bounds)
            self._unhook = probes.on_backward_start(self._bound)
            self.history = cuda_memory.start_history()  # CUDA only: allocator history for the window
        if i == self.warm:
            self.calibration = self._profile()
            self.guard.begin()
            _no_cycle_warning()
            _start_profiler(self.calibration)
            self._watch_from(calibrating=True)
        elif self.active and i == self.active[0] and self.guard is not None and self.cut is None:
            guard = self.guard
            guard.begin()
            self.drop = guard.drops(len(self.active))
            n = len(self.active) if guard.reads_decide else guard.steps_allowed(len(self.active))
            if n == 0 or not guard.fits():  # (one step, or the calibration's stretch, would pass the bounds)
                self.drop = None  # (nothing recorded: nothing recorded without shapes either)
                self.cut = guard.cut(i, nothing=True)
                self._release()
                return
            if n < len(self.active):  # (fewer steps, each predicted to cost what the calibration's did)
                self.cut = guard.cut(self.active[n - 1], planned=len(self.active))
            self.last = self.active[n - 1]
            self.prof = self._profile(window_schedule(0, n), self._write, guard.dropped)
            _no_cycle_warning()
            _start_profiler(self.prof)
            if guard.reads_decide:
                self._watch_from(calibrating=False)

    def _write(self, prof: Any) -> None:
        """The window's on_trace_ready: its trace, kept when a step of it fits its bounds."""
        if self._keep:
            from auditor.capture.trace_file import write_trace

            worker = "".join(c if c.isalnum() or c in "-._" else "_" for c in socket.gethostname())
            try:
                self.written.append(write_trace(prof, self.out_dir, self.run_name, f"{worker}_{os.getpid()}"))
            except Exception as e:  # (a full disk: the trace is lost, the program goes on as it would)
                self.unwritten = f"tb/{self.run_name}/"
                self.top_ops = [{"name": f"(profiler trace not written: {type(e).__name__}: {e})", "count": 0,
                                 "self_ms": 0.0, "total_ms": 0.0}]

    def _calibrated(self, whole: bool) -> None:
        """Stop the calibration and measure its end: the peak of stopping and exporting it over
        what it grew while recording, and its trace's compressed size. `whole`: it recorded the
        whole step (stopped at the step's end)."""
        from auditor.capture.session import rss_bytes
        from auditor.capture.trace_file import compressed_size

        self._unwatch()
        calibration, self.calibration = self.calibration, None
        guard = self.guard
        stop_rss = rss_bytes() or 0
        hwm = window_memory.peak_rss()
        try:
            calibration.stop()
            after_stop = rss_bytes() or 0
            size = compressed_size(calibration, self.out_dir)
        except Exception:  # the profiler failing must not fail the audit: the defaults stay
            return
        end_peak = max(after_stop, rss_bytes() or 0)
        if (now := window_memory.peak_rss()) > hwm:  # (the kernel saw the end's own peak)
            end_peak = max(end_peak, now)
        del calibration
        window_memory.release_freed()
        guard.calibrate(self.step if whole else None, stop_rss, end_peak, size)

    def after(self, i: int) -> None:
        if self.calibration is None and self.prof is None:  # (most steps: nothing to do)
            return
        with self._own():
            self._after(i)

    def _after(self, i: int) -> None:
        if self.calibration is not None:
            self._calibrated(whole=True)
        if self.prof is None:
            return
        if i != self.last:  # (the window ends at its last step's end anyway)
            self._bound(STEP_END)
        if self.prof is None:
            return
        self.prof.step()
        if i == self.last:
            self.stop()

    def _release(self) -> None:
        if self._unhook is not None:
            self._unhook()
            self._unhook = None
        if getattr(self, "history", False):
            snapshot = os.path.join(self.out_dir, "memory_snapshot.pickle")
            if cuda_memory.dump_snapshot(snapshot):
                self.snapshots.append(os.path.basename(snapshot))
            cuda_memory.stop_history()
            self.history = False

    def stop(self) -> None:
        with self._own():
            self._stop()

    def _stop(self) -> None:
        self._unwatch()
        if self.calibration is not None:  # (the run ended in the calibration: nothing measured)
            calibration, self.calibration = self.calibration, None
            try:
                calibration.stop()
            except Exception:
                pass
            self._release()
            return
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        if self._unhook is not None:
            self._unhook()
            self._unhook = None
        try:
            # (no key_averages() table here: with stacks and shapes it costs over a second; the
            # parent computes the same table from the trace file, see Trace.top_ops)
            prof.stop()
        except Exception as e:  # the profiler failing must not fail the audit
            self.top_ops = [{"name": f"(profiler failed: {type(e).__name__}: {e})", "count": 0,
                             "self_ms": 0.0, "total_ms": 0.0}]
        del prof
        window_memory.release_freed()
        self._release()
        kept = [f for f in self.written if os.path.isfile(f)]  # (this window's own: never another file of logdir's)
        if kept:
            self.files = sorted(os.path.relpath(f, self.out_dir) for f in kept)
            self.trace_bytes = sum(os.path.getsize(f) for f in kept)
            guard = self.guard
            if guard is not None and self.trace_bytes > guard.trace_bound:  # (predicted wrongly: none is kept)
                for f in kept:
                    os.unlink(f)
                cut = self.cut or guard.cut(self.last if self.last is not None else -1)
                self.cut = msgspec.structs.replace(cut, nothing=True, reason="trace-size",
                                                   dropped_trace_bytes=self.trace_bytes)
                self.files, self.trace_bytes = [], 0


SIGNALS_SEEN: list[str] = []  # the interrupting signals the child's handlers got, in order: the first ended the run


def catch_interrupts(catch_sigterm: bool) -> dict:
    """Install the child's SIGINT (and, when asked, SIGTERM) handlers; returns their counts.

    A Ctrl-C is never lost: code running when it lands (a library that catches KeyboardInterrupt)
    can swallow the exception, so the handler also counts it ("n"), and a step boundary that finds
    an interrupt nobody saw ("seen" < "n") ends the run as interrupted. A handler the user
    installed stays. SIGTERM likewise, unless the user's code handles it (a checkpoint on
    preemption); under a launcher the parent asks for nothing: there SIGTERM stops the ranks."""
    sigint = {"n": 0, "seen": 0}
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        def on_sigint(signum, frame):
            SIGNALS_SEEN.append("SIGINT")
            sigint["n"] += 1
            raise KeyboardInterrupt
        signal.signal(signal.SIGINT, on_sigint)
    if catch_sigterm and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        def on_sigterm(signum, frame):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (sent to the group: the parent forwards one too)
            SIGNALS_SEEN.append("SIGTERM")
            sigint["n"] += 1
            raise Terminated("stopped by SIGTERM")
        signal.signal(signal.SIGTERM, on_sigterm)
    return sigint


def run(args: wire.ChildRequest) -> int:
    """Set up the audit (_set_up), then call the step N times (or run the whole program), streaming
    every record; returns the exit code (2: TARGET is wrong, 3: the program failed)."""
    out = Writer(args.fd, args.parent_pid)
    faulthandler.enable(file=sys.stderr, all_threads=False)
    atexit.register(forget_codes)  # (registered first: it runs after the program's own atexit handlers)
    set_up = _set_up(args, out)
    if set_up is None:
        return 2
    rec, collectors = set_up
    if _is_program(args.target):  # a whole program, run as Python runs it: auditor.capture.program
        return _run_program(args, out, rec, collectors)
    step = _import_step(args, out, rec)
    if isinstance(step, int):
        return step
    return _run_steps(args, out, rec, collectors, *step)


def _set_up(args: wire.ChildRequest, out: Writer) -> tuple[probes.Recorder, list] | None:
    """Rehearsal (CUDA code on a CPU machine) first, then the stand-ins, then the probes, so each
    layer wraps the one before (a probe installed first would be replaced); then the collectors,
    and the hello. None when this torch cannot be audited (the usage error is sent)."""
    opts = args.options
    try:
        rehearsal_info = rehearsal.install(opts.rehearse_mode, *_target_source(args.target), argv=args.script_args)
    except torch_private.Unsupported as e:  # (before the target runs: one line, exit 2)
        out.send(wire.UsageError(message=str(e)))
        return None
    standins = [] if rehearsal_info else cuda_standins.install(lambda: probes.REC)
    rec = probes.install()
    warnings_name_the_user()
    # (the weights digest only when asked: it copies the whole model to the host at the end)
    collectors = load_collectors(skip=(*(() if opts.numerics else ("numerics",)),
                                       *(() if opts.records_digest else ("weights",))))
    for c in collectors:
        c.install()
    env = environment(standins)
    if rehearsal_info:
        env["rehearsal"] = True
        env["notes"].append(rehearsal_info.get("note", "CUDA rehearsal on the CPU"))
        _watch_rehearsed_memory(args.out, env, opts.device_memory)
    out.send(wire.Hello(environment=env, pid=os.getpid()))
    return rec, collectors


def _import_step(args: wire.ChildRequest, out: Writer, rec: probes.Recorder) -> tuple[Any, Callable, Any, int] | int:
    """The step target's module imported (its setup code run): (module, step function, its source,
    its arity), the setup's record sent; else the exit code, its ending sent."""
    try:
        target = parse_target(args.target)
        # what the user's code finds in sys.argv: its own file (or module) and the arguments after
        # `--`, as `python train.py ARGS` gives them; never the auditor's options (argparse fails)
        sys.argv = [target.file or target.module, *args.script_args]
        if target.file is not None:
            # `__main__.__file__` is the step file's, as it is the script's in a plain run (the
            # child's own `__main__` keeps its `__spec__`: a spawn worker re-imports it by that
            # name, never by its file, so no worker reruns the step file's setup)
            sys.modules["__main__"].__file__ = target.file
        module, fn, source = import_target(target)
        arity = step_arity(fn)
    except TargetError as e:
        out.send(wire.UsageError(message=str(e)))
        return 2
    except BaseException as e:  # the user's module code failed during setup
        out.send(wire.Setup(tallies=rec.drain(), backend_flags=backend_flags(), dataloaders=new_loaders(rec),
                            num_threads=torch.get_num_threads()))
        echo_exit_message(e)
        ending = _ending(e, None)
        if isinstance(e, ImportError) and "no known parent package" in exception_text(e):
            ending.message += _package_hint(target)
        ending.cuda_devices = cuda_devices()
        out.send(ending)
        return 3
    out.send(wire.Setup(tallies=rec.drain(), backend_flags=backend_flags(), dataloaders=new_loaders(rec),
                        num_threads=torch.get_num_threads()))
    return module, fn, source, arity


def _run_steps(args: wire.ChildRequest, out: Writer, rec: probes.Recorder, collectors: list, module: Any,
               fn: Callable, source: Any, arity: int) -> int:
    """The step called N times, each in a StepSession; then the window, the collectors' data and
    the ending sent."""
    opts = args.options
    # CUDA only: an out-of-memory error dumps the allocator's state before the report is written.
    if cuda_memory.attach_oom_observer(os.path.join(args.out, "oom_snapshot.pickle")):
        out.send(wire.Snapshot(path="oom_snapshot.pickle", when="oom"))
    prof = Profiler(args.out, args.run_name, opts.steps, opts.profile, opts.profile_memory, opts.trace_size)
    step_span = graphs.step_lines(fn, source)  # (a holder's growing line inside the step comes first)
    session = StepSession(out, rec, prof, collectors, graph_scan_points(opts.steps, prof.window()),
                          lambda: (module, source, step_span))
    sigint = catch_interrupts(args.catch_sigterm)
    status, ran_out = _call_steps(out, rec, session, prof, fn, arity, opts.steps, sigint,
                                  lambda e, i: _failure_scan(out, e, i, module, source, step_span))
    session.finish()
    prof.stop()
    if prof.window():
        out.send(wire.Profile(steps=[s for s in prof.recorded_steps() if s < opts.steps], trace_files=prof.files,
                              top_ops=prof.top_ops, snapshots=prof.snapshots, cut=prof.cut,
                              trace_bytes=prof.trace_bytes, drop=prof.drop, unwritten=prof.unwritten,
                              notes=prof.notes))
    for c in collectors:
        data = c.finish()
        if data is not None:
            out.send(wire.Collected(name=c.name, data=data))
    if ran_out is not None:
        out.send(ran_out)
    elif status == 0:
        out.send(wire.Ended(status="completed", backend_flags=backend_flags(), cuda_devices=cuda_devices()))
    return status


def _call_steps(out: Writer, rec: probes.Recorder, session: StepSession, prof: Profiler, fn: Callable, arity: int,
                steps: int, sigint: dict, scan_failure: Callable[[BaseException, int], None]) -> tuple[int, wire.Ended | None]:
    """Call the step `steps` times: (0, or 3 when it or the audit's work between steps raised (its
    ending sent); the ending when its data ran out)."""
    i = 0
    try:
        for i in range(steps):
            session.begin(i)
            try:
                fn(i) if arity else fn()
            except StopIteration as e:  # next() on an exhausted iterator: the data ran out
                session.drop(i)
                rec.drain()
                sigint["seen"] = sigint["n"]
                return 0, data_ran_out(e, i, steps)
            except BaseException as e:
                echo_exit_message(e)
                print_users_traceback(e)  # (as a plain run prints it, before the audit's summary)
                session.end(i, failed=True)
                sigint["seen"] = sigint["n"]
                out.send(_ending(e, i, cuda_devices()))
                if not isinstance(e, KeyboardInterrupt):
                    scan_failure(e, i)
                return 3, None
            session.end(i)
            if sigint["n"] > sigint["seen"]:  # delivered during this step, then swallowed on the way
                raise Terminated("stopped by SIGTERM") if SIGNALS_SEEN[:1] == ["SIGTERM"] else KeyboardInterrupt
    except BaseException as e:  # between steps (a Ctrl-C, or a handler of the program's raising in the
        # auditor's step-end work: a DataLoader's when its workers die): the run ends here
        echo_exit_message(e)
        print_users_traceback(e)
        prof.stop()
        ending = _ending(e, i, cuda_devices())
        code = getattr(fn, "__code__", None)
        if ending.where is None and code is not None:  # (it landed in the auditor's own step-end work:
            # the step it ended after is where, at its def line)
            ending.where = Frame(file=code.co_filename, line=code.co_firstlineno, function=code.co_name)
        out.send(ending)
        return 3, None
    return 0, None


def data_ran_out(exc: StopIteration, i: int, steps: int) -> wire.Ended:
    """A step whose `next(it)` raised StopIteration: its data ran out after i steps. The program
    stopped as a plain loop over its data does (not a failure), and the step that found no data
    is no step: the steps counted are the i that ran."""
    return wire.Ended(status="exited", step=i, exception="StopIteration", where=_frame_of_exception(exc),
                      message=f"the data ran out after {i} step(s) of the {steps} asked for: "
                              f"step {i} raised StopIteration (its iterator was exhausted)",
                      backend_flags=backend_flags(), cuda_devices=cuda_devices())


def _is_program(spec: str) -> bool:
    try:
        return parse_target(spec).is_program
    except TargetError:
        return False


def _run_program(args: wire.ChildRequest, out: Writer, rec: probes.Recorder, collectors: list) -> int:
    """`audit run file.py` / `audit run -m pkg.mod`: the program's steps are found as it runs."""
    def send_setup() -> None:
        out.send(wire.Setup(tallies=rec.drain(), backend_flags=backend_flags(), dataloaders=new_loaders(rec),
                            num_threads=torch.get_num_threads()))

    if cuda_memory.attach_oom_observer(os.path.join(args.out, "oom_snapshot.pickle")):
        out.send(wire.Snapshot(path="oom_snapshot.pickle", when="oom"))
    catch_interrupts(args.catch_sigterm)
    opts = args.options
    prof = Profiler(args.out, args.run_name, opts.steps, opts.profile, opts.profile_memory, opts.trace_size)
    parts = ChildParts(out, rec, collectors, prof, graph_scan_points(opts.steps, prof.window()), send_setup, _ending,
                       backend_flags, cuda_devices)
    return run_program(parse_target(args.target), args, parts)


def _watch_rehearsed_memory(out_dir: str, env: dict, device_gib: float | None) -> None:
    """With --device-memory, a rehearsal records its device's requests itself (as a GPU run has its
    allocator): each step's end states the device memory they hold, and the step that outgrows the
    device writes the snapshot a GPU would have (auditor.capture.rehearsal.memory.watch)."""
    from auditor.capture import session as step_session
    from auditor.capture.rehearsal import memory as rehearsed_memory

    if rehearsed_memory.watch(out_dir, device_gib):
        step_session.REHEARSED_MEMORY = rehearsed_memory.step_end
        env["notes"].append("device memory: the rehearsed device's requests were recorded; each step's device "
                            "allocated memory is the bytes they requested (a lower bound)")


def _failure_scan(out: Any, e: BaseException, i: int, module: Any, source: str | None, step_span: Any) -> None:
    """A graph scan after a step that raised: an out-of-memory error is where a leak ends, and what
    holds the memory is still held now. The traceback's frames are cleared first (the ending is
    sent): their locals (the failed step's loss and its graph) are no leak. Best effort: the scan
    must not hide how the run ended."""
    try:
        traceback.clear_frames(e.__traceback__)
        out.send(wire.GraphScan(after_step=i, failed=True, **graphs.scan(module, source, step_span)))
    except Exception:
        pass


def _target_source(spec: str) -> tuple[str | None, str | None]:
    """(file, None) for a file target, (None, dotted module name) for a module's; rehearsal reads it."""
    try:
        t = parse_target(spec)
    except TargetError:
        return None, None
    return (t.file, None) if t.file is not None else (None, t.module)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = wire.decode_request(argv[0])  # (the parent's one argv value: auditor.capture.runner.run_child)
    # torch has read them (at import; the profiler reads them when it starts): the program sees
    # the environment the user gave `audit`
    for name in args.added_env:
        ADDED_ENV[name] = os.environ.pop(name, "")
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)
    code = run(args)
    # Every record is sent: the process now ends as Python ends a program (its threads joined, its
    # atexit handlers run, its files flushed), within exit_grace_s() (see bound_exit).
    bound_exit(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
