"""The typed evidence model: everything a run or a recording tells the rules.

Capture produces it, rules read it, reports render it. It is plain data (msgspec Structs) so it can be
saved next to a run and loaded again: `audit analyze DIR` is load -> rules -> reports, with no special
path. Nothing here imports torch.
"""
from __future__ import annotations

import statistics
from typing import Any

import msgspec

from auditor.evidence.checkpoint_summary import CheckpointSummary
from auditor.evidence.distributed import DistInfo, DistStep
from auditor.evidence.frame import Frame
from auditor.evidence.numerics import NumericsFinal, NumericsStep
from auditor.evidence.ranks.model import RankIdentity, RankSet

# 2: each collector's data in the field named after it (StepRecord.numerics, Evidence.checkpoint,
# ...). A version-1 document held them in an `extra` mapping by name: decode() reads both.
EVIDENCE_VERSION = 2

# Kinds of probe tallies recorded while steps run (see auditor.capture.probes).
SYNC = "sync"  # a device->host synchronisation: .item(), .cpu(), bool(t), torch.cuda.synchronize() ...
# `what` of a SYNC torch.distributions makes to check a distribution's arguments, or a value given to
# its log_prob (validate_args, on by default), at the user's line that made it or called log_prob
DISTRIBUTION_CHECK = "torch.distributions argument check"
BACKWARD = "backward"  # Tensor.backward / autograd.backward / autograd.grad
RETAINED_UNUSED = "retained-unused"  # a retain_graph=True graph never backpropagated again
# a retained graph counted unused in its step that the next step's backward then ran into: a tensor
# carried across steps holds it (an RNN state not detached); counted again, at its own place
RETAINED_CARRIED = "retained-carried"
ANOMALY_ON = "anomaly-on"  # anomaly detection switched on (set_detect_anomaly / detect_anomaly)
# `what` of the ANOMALY_ON tally a backward adds when it ran with anomaly detection on: a step can
# switch it on and off inside itself (`with torch.autograd.detect_anomaly():`), which the flag
# read at each step's start misses
ANOMALY_BACKWARD = "backward under anomaly detection"
STAT_RESET = "stat-reset"  # torch.cuda.reset_peak_memory_stats and friends
EMPTY_CACHE = "empty-cache"  # torch.cuda.empty_cache
GC_COLLECT = "gc-collect"  # gc.collect
SAVE = "save"  # torch.save in a step; data: path (absolute; None for a buffer or file object)
# time inside DataLoader iteration (__next__), less the thread's run-queue delay (ready while another
# process held the CPU: capture.run_queue; in a rehearsal, less the rehearsal's own time instead);
# data: loader, and exhausted=True on the calls that ended an epoch (StopIteration: no batch), so
# the other tallies' counts are of batches returned
DATA_WAIT = "data-wait"
# a DataLoader iterator made (iter(loader), a `for` over it: starts its worker processes) or its
# workers shut down (an iterator dropped) in the step; data: loader, workers
DATA_ITER = "data-iter"
# the batches a DataLoader's worker processes finished since the step's previous fetch from it, read
# at the fetch (__next__); data: loader, workers, batches, ms and cpu_ms (the workers' time making them,
# and their own CPU time: the dataset's __getitem__/__iter__ and the collate_fn, each timed on its
# worker's thread; ms past cpu_ms is waiting: reads, sleeps, other processes on the cores).
# Workers forked from the audited process only (Linux's default); none for spawned ones
DATA_WORKER = "data-worker"
# a process the program started itself (multiprocessing.Process.start, by the user's code or a
# library it called: torch.multiprocessing.spawn's workers; not a DataLoader's workers): what runs
# in it is not audited; data: method (its start method), target (the function it runs)
PROCESS_START = "process-start"
# a DistributedSampler's iteration started (once per epoch, at the user's line that started the
# DataLoader's epoch); data: sampler (id), epoch (its epoch then, which seeds its shuffle), shuffle,
# made_file/made_line (where the sampler was made), prev_finished (whether its previous iteration
# used up its indices: False for one left early, a peek; None when unknown or first)
SAMPLER_ITER = "sampler-iter"
# a hook registered at the user's line (Tensor.register_hook, Module.register_forward_hook ...);
# data: held, the most hooks of that kind one tensor or module registered there held just after
# (a hook registered every step on the same parameters piles up: every backward runs them all),
# and holders, how many tensors or modules the step registered them on
HOOK = "hook"
FORWARD = "forward"  # outermost nn.Module call (timed by global module hooks)
# an outermost forward's autograd graph, freed: what "used" (a backward pass ran through it) or
# "unused". Counted where it was freed, at the forward's line (capture.probes.graph_use)
GRAPH_USE = "graph-use"
OPTIMIZER = "optimizer"  # Optimizer.step
CUDA_STANDIN = "cuda-standin"  # a torch.cuda call answered as an idle device would (no CUDA here)
# Recorded only in CUDA rehearsal (auditor.capture.rehearsal), where no trace shows what a GPU would do:
H2D_COPY = "h2d-copy"  # a host->device copy the program asked for; data: bytes, pinned, non_blocking, loader
DEVICE_BATCH = "device-batch"  # a DataLoader batch that came out already on the GPU; data: loader, tensors, bytes
DATA_DEVICE_OP = "data-device-op"  # a GPU tensor created inside DataLoader iteration (.cuda() in __getitem__ ...)
# a matmul or convolution of GPU tensors (what: "F.linear", "conv2d" ...); data: dtype (what it
# computes in: autocast's dtype under autocast), autocast, flops (of the call), conv, tf32 (the TF32
# flag of its kind in force), and for convolutions shape (the input's) and benchmark (cudnn.benchmark then)
DEVICE_MATMUL = "device-matmul"
# an in-place update of a parameter that has a gradient, by the user's code outside Optimizer.step
# (`p.data.add_(p.grad, alpha=-lr)`); data: numel (the parameter's)
PARAM_UPDATE = "param-update"
# the kernel launches the program's GPU calls would make, per call site and op (what: "Tensor.mul_",
# "F.linear" ...; count: launches) and size class: data: bytes_class and flops_class (bit lengths of
# one launch's bytes moved and FLOPs), dtype (of the output: the FLOPs' precision), bytes and flops
# (sums over the launches: bytes moved is the tensor inputs read plus the outputs written; FLOPs are
# known for matmuls and convolutions, 0 elsewhere), caller ([file, line] where the user's code
# called the function the call site is in, or null: a forward called per token of a loop there
# launches per token). Views and metadata (view, reshape, size, detach,
# transpose, expand ...) launch nothing and are not counted; nor is torch.optim's own code (on a GPU
# it takes its foreach path, a few launches for all parameters).
DEVICE_LAUNCH = "device-launch"
# time a step spent at a line of the user's code (sampled; library calls below it charged to it):
# count: samples, ms: time charged (auditor.capture.lines)
LINE_TIME = "line-time"


class Tally(msgspec.Struct):
    """How often one probed thing happened at one place during one step, and the time it took."""

    kind: str
    what: str  # the API, e.g. "Tensor.item", "torch.cuda.empty_cache"
    where: Frame | None
    count: int = 0
    ms: float = 0.0
    data: dict[str, Any] = {}


def one_fetch(pairs: list[tuple[Any, Tally]]) -> list[tuple[Any, Tally]]:
    """(group, tally) pairs (a step's index, a stretch's) without the SYNC `.numpy()` of a `.cpu()`
    tallied at the same line in the same group (`action.cpu().numpy()`): it reads the host copy
    `.cpu()` made, one fetch. On an accelerator only the `.cpu()` is the device's; a CPU-only run
    tallies both calls."""
    def at(k: Any, t: Tally) -> tuple:
        return k, t.where.file if t.where else None, t.where.line if t.where else None

    copied = {at(k, t) for k, t in pairs if t.kind == SYNC and t.what == "Tensor.cpu"}
    return [(k, t) for k, t in pairs if not (t.kind == SYNC and t.what == "Tensor.numpy" and at(k, t) in copied)]


class StepRecord(msgspec.Struct):
    """One call of the user's step: its wall time, memory at its end, and what the probes saw in it."""

    index: int
    start_s: float  # seconds since the first step started
    ms: float  # the host's clock: from the step's beginning to its end in the program
    cpu_ms: float | None = None  # process CPU time in the step: unaffected by other processes' load
    # The time the step's thread was ready to run but waited for a CPU that other work held (Linux's
    # schedstat run delay), from the previous step's end (the boundary before it is ~0.1 ms): other
    # processes' load, measured. None where the kernel does not keep it.
    waited_ms: float | None = None
    # The device's clock: from the step's beginning to its end on the stream it ran on (CUDA events
    # recorded at its boundaries, read once completed, never waited for: auditor.capture.device_clock).
    # None: no device in use, or its events did not complete (the step is then on the host's clock).
    device_ms: float | None = None
    profiled: bool = False
    failed: bool = False  # the step raised or was interrupted: its time is partial
    rss_bytes: int | None = None
    device_allocated: int | None = None  # CUDA allocator, when a real device is in use
    device_reserved: int | None = None
    anomaly_enabled: bool = False
    # the line sampler looked at the step (its line-time tallies are its per-line times); after the
    # dense start only one step in 16 is sampled, fewer in a long run (auditor.capture.lines).
    # Recordings made before that sampled every unprofiled step.
    lines_sampled: bool = True
    # The audit's own work at the boundary before the step, timed: from the last step's end (its
    # time taken) to this one's start, what the audit ran there (the last step's record, the
    # profiler's stepping and trace export, a graph scan, the profiler's start). In the time between
    # the steps, not in either step (auditor.evidence.run_time). None: the first step, or not timed.
    own_before_ms: float | None = None
    tallies: list[Tally] = []
    numerics: NumericsStep | None = None  # the numerics collector's record of the step
    distributed: DistStep | None = None  # the distributed collector's record of the step (None: nothing distributed)

    @property
    def time_ms(self) -> float:
        """The step's time on its bound: the longer of the host's and the device's clocks. A host
        that queues a GPU-bound step in 2 ms does not make a 60 ms step 2 ms long."""
        return self.ms if self.device_ms is None else max(self.ms, self.device_ms)


class GraphScan(msgspec.Struct):
    """Tensors carrying autograd history that outlived a step, seen at a step boundary."""

    after_step: int
    tensors: int  # live non-leaf tensors with a grad_fn
    graph_nodes: int  # autograd nodes reachable from them
    holders: list[dict[str, Any]] = []  # [{"name", "kind", "tensors", "nodes", "where": Frame|None}]
    failed: bool = False  # after a step that raised (an out-of-memory error): what held memory then


class DataLoaderInfo(msgspec.Struct):
    """A DataLoader the step iterates, with the settings that decide input-pipeline speed."""

    id: int
    where: Frame | None
    settings: dict[str, Any] = {}
    # the library functions between the user's line and the DataLoader's construction, innermost
    # first ("transformers/trainer.py:Trainer.get_train_dataloader < ..."); "" when the user made it
    via: str = ""
    # The parameters the call gave (by position, by name or through `**mapping`), as the probe saw
    # them bound; None when not recorded (older evidence). A fix adds no keyword named here: the
    # call would raise "got multiple values".
    passed: list[str] | None = None


class Environment(msgspec.Struct):
    torch_version: str = ""
    python_version: str = ""
    platform: str = ""
    hostname: str = ""
    device: str = "cpu"  # the device the program computes on
    cuda_available: bool = False
    cuda_standins: bool = False  # torch.cuda memory-stat calls were answered as an idle device would
    rehearsal: bool = False  # CUDA code rehearsed on the CPU (auditor.capture.rehearsal)
    num_threads: int | None = None
    env_vars: dict[str, str] = {}
    backend_flags: dict[str, Any] = {}
    # Every visible CUDA device as torch.cuda.get_device_properties reported it at the end of a run
    # whose program used CUDA: [{"index", "name", "total_memory" (bytes), "memory_fraction" (the
    # per-process fraction set, 1.0 when none)}]; empty on the CPU or
    # when the program never initialised CUDA (oom-risk reads the capacity here)
    cuda_devices: list[dict[str, Any]] = []
    notes: list[str] = []
    # The device model's row (auditor.evidence.devices, its key) that `--device` chose: what the
    # GPU figures are judged by when the trace names no known device, and what a rehearsed run's
    # costs are estimated on. Empty: none chosen.
    device_model: str = ""


class WindowCut(msgspec.Struct, frozen=True):
    """The profiler window ended early, in step `step`, to keep within its bounds
    (auditor.capture.window_memory): it had recorded until the process held `rss_bytes` resident,
    having started the window with `start_rss_bytes`, against `limit_bytes` (that start plus
    --profile-memory) for the whole window, its end included. `reason`: the bound that ended it,
    "memory" or "trace-size" (`trace_limit_bytes`, the compressed trace's). `factor`: the end's
    peak growth over the recording's growth it was predicted by, measured on step `calibrated_on`
    (None: the default); `stride_bytes`: the largest growth between two of its reads. `nothing`:
    no whole step fitted, so the window kept no trace. `warm_up_cut`: its warm-up step's recording,
    the calibration, was cut short too."""

    step: int
    rss_bytes: int
    start_rss_bytes: int
    limit_bytes: int
    reason: str = "memory"
    nothing: bool = False
    factor: float = 0.0
    calibrated_on: int | None = None
    stride_bytes: int = 0
    trace_limit_bytes: int = 0
    # the calibration's whole step (`calibrated_on`): its recording and end's peak growth, and its
    # compressed trace, what each step of the window was predicted to cost
    step_cost_bytes: int = 0
    step_trace_bytes: int = 0
    planned: int = 0  # the window was shortened before it began: it recorded `step`'s and the steps
    # before it of `planned` active steps (0: it ended at a read of its memory)
    dropped_trace_bytes: int = 0  # its trace was written over --trace-size, and removed
    # the bound over `start_rss_bytes` that would record step `step` whole, estimated from what was
    # measured (a lower estimate where no whole step was: `calibrated_on` None); 0: unknown
    need_bytes: int = 0
    # the window's warm-up step, which measures a whole step's recording, did not fit its own
    # recording either (no whole step measured although the window had a step before it)
    warm_up_cut: bool = False


class WindowDrop(msgspec.Struct, frozen=True):
    """The profiler window recorded without `dropped` ("record_shapes", "with_stack": torch.profiler's
    options) to fit its bounds (auditor.capture.window_memory): a step recorded with shapes and
    stacks, measured whole on step `calibrated_on`, cost `step_cost_bytes` to record and end and
    `step_trace_bytes` of trace, at which `fitted` of its `planned` steps fitted `reason`'s bound
    ("memory": `limit_bytes`, --profile-memory over `start_rss_bytes`; "trace-size":
    `trace_limit_bytes`). Its reads of the process's memory then decided how much it recorded."""

    dropped: list[str]
    calibrated_on: int
    step_cost_bytes: int
    step_trace_bytes: int
    fitted: int
    planned: int
    reason: str = "memory"
    start_rss_bytes: int = 0
    limit_bytes: int = 0
    trace_limit_bytes: int = 0


class ProfileWindow(msgspec.Struct):
    """The steps run under torch.profiler and where their trace was written."""

    steps: list[int]
    trace_files: list[str] = []  # relative to the run directory
    cut: WindowCut | None = None  # the window ended early to bound its memory
    drop: WindowDrop | None = None  # the window recorded without shapes or stacks to fit its bounds
    # the audited process's peak resident memory, read by the parent from outside it (its VmHWM);
    # 0: not read (a trace loaded by `audit analyze`)
    peak_rss_bytes: int = 0
    trace_bytes: int = 0  # the kept trace's size on disk (compressed)
    # [{"name", "count", "self_ms", "total_ms"}] by self time, when given: the child sends only a
    # failed profiler's note here; the report computes the table from the trace (Trace.top_ops)
    top_ops: list[dict[str, Any]] = []


class Ending(msgspec.Struct):
    """How the run ended. status: completed | exited (the program stopped itself with sys.exit(0),
    as it does without the audit) | raised | interrupted | oom | crashed."""

    status: str = "completed"
    step: int | None = None  # the step it ended in, if inside one
    exception: str | None = None  # e.g. "RuntimeError"
    message: str | None = None
    traceback: str | None = None
    where: Frame | None = None
    returncode: int | None = None
    signal: str | None = None
    stderr_tail: str | None = None
    # a sentence when the audit, not the program, made it fail (its CUDA rehearsal: rehearsal.blame)
    audit_cause: str | None = None


def ended_well(ending: Ending) -> bool:
    """Whether the target did not fail: it ran every step, or stopped itself with a zero exit
    code (an early stop on convergence; a setup that finds nothing to do), as a plain run exits 0."""
    return ending.status in ("completed", "exited")


class Outside(msgspec.Struct):
    """What the probes saw in a stretch of a whole program outside its audited steps (setup, before
    the first step, is `Evidence.setup`).

    phase: "between" (after an audited step, before the next: an eval loop, a checkpoint save) or
    "after" (after the last audited step, to the program's end: its `finally` blocks, its exit);
    after_step: the audited step it follows; ms: its wall time; tallies: the probes' tallies."""

    phase: str
    after_step: int | None = None
    ms: float = 0.0
    tallies: list[Tally] = []


class Program(msgspec.Struct):
    """A whole program audited as Python runs it (`audit run file.py`, `audit run -m pkg.mod`).

    form: "script" (`file.py`) or "module" (`-m pkg.mod`); argv: its sys.argv; steps_by: how its steps were found,
    "optimizer" (its optimizer steps), "dataloader" (its training DataLoader's iterations),
    "marker" (its `auditor.step()` calls), "update" (its weight updates outside torch.optim) or "none"; steps_found: the same as the report says it
    ("optimizer steps (Adam), 1 per iteration"); skipped: steps run unaudited first (--skip);
    ended_by_audit: --steps N ended it at a step boundary after N steps, as a Ctrl-C does;
    exit_code: the program's own exit code (its sys.exit's; 0 when it ran to its end), None when
    the audit ended it or it raised; after_stop: what the program raised after it caught the
    audit's interrupt and went on ("FileNotFoundError: ... at main.py:247"; its Ctrl-C path), "" when nothing."""

    form: str
    argv: list[str] = []
    steps_by: str = "none"
    steps_found: str = ""
    skipped: int = 0
    ended_by_audit: bool = False
    exit_code: int | None = None
    after_stop: str = ""


class WeightsDigest(msgspec.Struct):
    """The trained state at the end of the audited steps (the `weights` collector, recorded for
    `audit run --verify`): sha256 over every live optimizer's parameters and per-parameter state,
    or, in a program without torch.optim, over the parameters of the root modules it trains.

    sha256: the digest ("" when it could not be taken; `error` says why).
    optimizers, modules, tensors, bytes: how many optimizers (or root modules) and tensors it
    covers, and their bytes.
    error: why no digest was taken."""

    sha256: str
    optimizers: int = 0
    modules: int = 0
    tensors: int = 0
    bytes: int = 0
    error: str | None = None
class SourceFile(msgspec.Struct):
    """A source file as the audit read it: what the reports quote from it, kept so that a later
    `audit report DIR` / `audit analyze DIR` shows the lines as they were, and says when the file
    has changed since (auditor.evidence.sources).

    sha256: the hex digest of its bytes when first quoted; lines: {line number: its text, without
    the line ending} for the lines quoted (each finding's place and the lines around it, each
    recorded frame's line)."""

    sha256: str
    lines: dict[int, str] = {}


class Evidence(msgspec.Struct, dict=True):
    """Everything the rules may read. Fields are empty when the source did not provide them.

    Recordings (profiler traces, memory snapshots) are referenced by path; their parsed form is
    attached at load time as `trace_data` / `snapshot_data` (runtime attributes, never serialised).
    """

    version: int = EVIDENCE_VERSION
    source: str = "run"  # run | trace | snapshot | checkpoint
    target: str = ""
    requested_steps: int = 0
    environment: Environment = msgspec.field(default_factory=Environment)
    setup: list[Tally] = []  # what probes saw at import time, before the first step
    outside: list[Outside] = []  # a whole program's stretches outside its steps (see Outside)
    program: Program | None = None  # set when a whole program ran (see Program)
    steps: list[StepRecord] = []
    graph_scans: list[GraphScan] = []
    dataloaders: list[DataLoaderInfo] = []
    profile: ProfileWindow | None = None
    ending: Ending = msgspec.field(default_factory=Ending)
    traces: list[str] = []  # profiler traces (Chrome/Kineto JSON), relative to the run dir or absolute
    snapshots: list[str] = []  # CUDA memory snapshot pickles
    numerics: NumericsFinal | None = None  # the numerics collector's record at the end of the run
    distributed: DistInfo | None = None  # the distributed setup the run saw (None: nothing distributed)
    rank: RankIdentity | None = None  # who recorded it, when a rank of a launched job did
    ranks: RankSet | None = None  # the merged view of all ranks, on the evidence merged from them
    checkpoint: CheckpointSummary | None = None  # what `audit checkpoint` read
    weights: WeightsDigest | None = None  # the trained state's digest (recorded for --verify)
    # {path: SourceFile}: each source file the reports quote, as first read (absent from evidence
    # written before it was kept: such a file is quoted as it is on disk)
    sources: dict[str, SourceFile] = {}
    # The directories the audited program's own code is in (`audit run`: the project's roots), the
    # only ones its source is quoted from (auditor.evidence.source_access); a later `audit analyze`
    # or `audit report` of the run directory on the same machine reads under them again
    source_roots: list[str] = []

    @property
    def trace_data(self) -> list[Any]:
        """Parsed traces (auditor.evidence.trace.model.Trace), attached by the loader."""
        return self.__dict__.get("trace_data", [])

    @property
    def snapshot_data(self) -> list[Any]:
        """Parsed memory snapshots, attached by the loader."""
        return self.__dict__.get("snapshot_data", [])

    # Helpers rules share. Derived, never stored.
    def step_ms(self, include_profiled: bool = False) -> list[float]:
        """Wall time of each step, leaving out the profiled ones (the profiler slows them)."""
        return [s.ms for s in self.steps if not s.failed and (include_profiled or not s.profiled)]

    def timed_steps(self) -> list[StepRecord]:
        """Steps with nothing of the audit's in them (auditor.capture.numerics.schedule): not
        profiled and, when the run checked numerics on some steps, not one of those."""
        ok = [s for s in self.steps if not s.failed and not s.profiled]
        if any(s.numerics is not None for s in self.steps):
            return [s for s in ok if s.numerics is None]
        return ok

    def median_basis(self) -> list[StepRecord]:
        """The steps the reported median is of: the timed steps, else the unprofiled ones, else all."""
        return self.timed_steps() or [s for s in self.steps if not s.failed and not s.profiled] or \
            [s for s in self.steps if not s.failed]

    def median_step_ms(self) -> float | None:
        """The median of median_basis, each step on its bound's clock (StepRecord.time_ms: the
        device's where it is the longer)."""
        steps = self.median_basis()
        return statistics.median(s.time_ms for s in steps) if steps else None

    def shown_step_ms(self) -> list[float]:
        """Per-step wall times the reports show: the run's own steps, or, for recordings analysed
        on their own, the ProfilerSteps of the first trace that has any. Rules keep reading
        `steps`, which stays empty for recordings: a trace's rules measure against its own steps."""
        if self.steps:
            return [s.time_ms for s in self.steps]
        for trace in self.trace_data:
            if len(trace.steps):
                return [float(d) for d in trace.step_times_ms()]
        return []

    def shown_trace(self) -> Any | None:
        """The parsed trace whose ProfilerSteps the reports show (shown_step_ms), for recordings
        analysed on their own; None for a run (its own steps) or when no trace has steps."""
        if self.steps:
            return None
        return next((t for t in self.trace_data if len(t.steps)), None)

    def shown_median_ms(self) -> float | None:
        """The median step the reports state (see shown_step_ms), and every cost's share is of."""
        median = self.median_step_ms()
        if median is None:
            trace = next((t for t in self.trace_data if len(t.steps)), None)
            median = trace.median_step_ms() if trace is not None else None
        return median

    def median_check_ms(self) -> float | None:
        """Median time per step the numerics checks took inside the step (its wall time includes
        it): how much of a step's time is the audit's own. None when no step was checked."""
        times = [d.check_in_step_ms for s in self.steps
                 if not s.failed and not s.profiled and (d := s.numerics) is not None
                 and d.check_in_step_ms is not None]
        # (rounded once, here, so that findings.json, the summary and the report show one number:
        # a median of two values rounded again in each could show 0.64 beside 0.65)
        return round(statistics.median(times), 3) if times else None

    def tallies(self, kind: str, include_setup: bool = False) -> list[tuple[int, Tally]]:
        """(step index, tally) for every tally of a kind; step -1 is setup (import time)."""
        out = [(-1, t) for t in self.setup if t.kind == kind] if include_setup else []
        for s in self.steps:
            out.extend((s.index, t) for t in s.tallies if t.kind == kind)
        return out


LOAD_NOTES = "load_notes"  # Evidence.__dict__ key: the notes add_load_note added


def add_load_note(evidence: Evidence, note: str) -> None:
    """Note what loading found (a trace missing or damaged, the device a recording names): shown by
    this render's reports, never saved (auditor.evidence.store.save leaves it out), since every
    load finds it again from the files as they are then. Saved, it would pile up over re-renders
    and outlive its cause (a trace put back); added twice, it would be said twice."""
    if note not in evidence.environment.notes:
        evidence.environment.notes.append(note)
    evidence.__dict__.setdefault(LOAD_NOTES, []).append(note)


def encode(evidence: Evidence) -> bytes:
    return msgspec.json.encode(evidence)


def decode(data: bytes) -> Evidence:
    """Evidence from evidence.json, of this version or version 1 (see EVIDENCE_VERSION)."""
    evidence = msgspec.json.decode(data, type=Evidence)
    return evidence if evidence.version >= 2 else _from_version_1(msgspec.json.decode(data))


def _from_version_1(doc: dict[str, Any]) -> Evidence:
    """A version-1 document: each key of the `extra` mappings (the evidence's and each step's) goes
    into the field of the same name, converted to its type. A key with no such field is dropped,
    with a load note."""
    dropped: list[str] = []

    def lift(d: dict[str, Any], struct: type) -> None:
        names = {f.name for f in msgspec.structs.fields(struct)}
        for key, value in (d.pop("extra", None) or {}).items():
            if key in names and key not in d:
                d[key] = value
            elif key not in dropped:
                dropped.append(key)

    lift(doc, Evidence)
    for step in doc.get("steps") or []:
        if isinstance(step, dict):
            lift(step, StepRecord)
    doc["version"] = EVIDENCE_VERSION
    evidence = msgspec.convert(doc, type=Evidence)
    for key in dropped:
        add_load_note(evidence, f"evidence.json (version 1): its {key!r} data is not read by this version")
    return evidence
