"""The records the child process sends the parent (auditor.capture.stream), one JSON object a line.

Each record is a Struct of the tagged union `Record`; its `kind` field names the type ("step",
"ended", ...). The child encodes them with `encode` (one reused encoder: the step record is sent at
every step boundary) and the parent decodes each line with `DECODER` into the typed record.

Places in the user's code travel as `Frame`s without their source line (`code` empty): the parent
reads the line (auditor.evidence.frame.recorded_frame). Lists the child builds from the probes'
plain dicts (tallies, dataloaders) are sent as those dicts: they have the shape of the field's type,
and decode into it.

A collector's data (auditor.capture.collectors) travels as the collector made it (`Any`): the
parent converts it into the StepRecord/Evidence field named after the collector.

The parent's one message the other way, `ChildRequest`, is the child's command line: one JSON value.
"""
from __future__ import annotations

from typing import Any, Union

import msgspec

from auditor.capture import held_output
from auditor.command_options import RunOptions, decode, encode as encode_json
from auditor.evidence.model import DataLoaderInfo, Environment, Program, Tally, WindowCut, WindowDrop
from auditor.evidence.frame import Frame


class Record(msgspec.Struct, tag_field="kind", omit_defaults=True):
    """A record of the evidence stream; `kind` (the tag) names its type."""


class Hello(Record, tag="hello"):
    """The child is up, its probes installed: the first record.

    environment: the machine, torch and the settings read before the target ran.
    pid: the child's process id."""

    environment: Environment
    pid: int


class UsageError(Record, tag="usage-error"):
    """TARGET itself is wrong (no such file or callable): nothing ran; the only record after hello.

    message: the one line for the user."""

    message: str


class Setup(Record, tag="setup"):
    """The target's module was imported (its setup code ran, or failed: then `ended` follows).

    tallies: what the probes saw at import time.
    backend_flags: the program's backend settings after its setup (auditor.capture.child._FLAGS).
    dataloaders: DataLoaders made during setup.
    num_threads: torch's intra-op thread count as the setup left it."""

    tallies: list[Tally] = []
    backend_flags: dict[str, Any] = {}
    dataloaders: list[DataLoaderInfo] = []
    num_threads: int | None = None


class Step(Record, tag="step"):
    """One call of the user's step, sent as soon as it returned (or raised).

    index: the step's number, from 0.
    start_s: seconds from the first step's start to this one's.
    ms, cpu_ms: its wall time and the process's CPU time in it.
    waited_ms: the time its thread was ready to run but waited for a CPU that other work held,
        counted from the previous step's end (the step and the boundary before it, ~0.1 ms; from
        its own start for the first), session.waited_ms; None where the kernel does not keep it.
    profiled: it ran under torch.profiler.
    failed: it raised or was interrupted: its time is partial.
    rss_bytes: resident memory at its end.
    device_allocated, device_reserved: the CUDA allocator's bytes at its end (a real device only).
    anomaly_enabled: anomaly detection was on when it started.
    lines_sampled: the line sampler looked at it (auditor.capture.lines: not every step is).
    own_before_ms: the audit's own work at the boundary before it, after the last step's time was
        taken (its record, the profiler's stepping and trace export, a graph scan) and before this
        step's was (the profiler's start); None for the first step.
    tallies: what the probes saw in it.
    collected: each collector's data for this step, by collector name.
    dataloaders: DataLoaders first seen in this step."""

    index: int
    start_s: float
    ms: float
    cpu_ms: float | None = None
    waited_ms: float | None = None
    profiled: bool = False
    failed: bool = False
    rss_bytes: int | None = None
    device_allocated: int | None = None
    device_reserved: int | None = None
    anomaly_enabled: bool = False
    lines_sampled: bool = True
    own_before_ms: float | None = None
    tallies: list[Tally] = []
    collected: dict[str, Any] = {}
    dataloaders: list[DataLoaderInfo] = []


class GraphScan(Record, tag="graph-scan"):
    """Tensors with autograd history alive at a step boundary (auditor.capture.graphs.scan).

    after_step: the step it followed.
    tensors, graph_nodes: live non-leaf tensors and the autograd nodes they reach.
    holders: what holds them, as graphs.scan describes each (its "where" a frame dict).
    failed: the step before raised (an out-of-memory error)."""

    after_step: int
    tensors: int
    graph_nodes: int
    holders: list[dict[str, Any]] = []
    failed: bool = False


class Profile(Record, tag="profile"):
    """The profiler window ended.

    steps: the steps it covered.
    trace_files: its traces, relative to the run directory.
    top_ops: only a failed profiler's note ({"name", "count", "self_ms", "total_ms"}).
    snapshots: CUDA memory snapshots of the window, relative to the run directory.
    cut: the window ended early to bound its memory (auditor.capture.window_memory).
    drop: the window recorded without shapes or stacks to fit its bounds.
    trace_bytes: the traces' size on disk (compressed).
    unwritten: where the trace it could not write (a full disk) was to go ("" when none).
    notes: what the window did otherwise than asked, and why (for the evidence's notes)."""

    steps: list[int]
    trace_files: list[str] = []
    top_ops: list[dict[str, Any]] = []
    snapshots: list[str] = []
    cut: WindowCut | None = None
    trace_bytes: int = 0
    drop: WindowDrop | None = None
    unwritten: str = ""
    notes: list[str] = []


class DeviceTimes(Record, tag="device-times"):
    """Steps' times on the device's clock (auditor.capture.device_clock), sent as their events
    complete: after later steps, and at the run's end.

    steps, ms: the steps and their device times, pairwise; note: the steps left on the host's
    clock and why (sent with the last record only)."""

    steps: list[int] = []
    ms: list[float] = []
    note: str = ""


class Snapshot(Record, tag="snapshot"):
    """A memory snapshot the child may write later (the OOM observer's).

    path: relative to the run directory; listed in the evidence only if it exists at the end.
    when: what writes it ("oom")."""

    path: str
    when: str = ""


class Collected(Record, tag="collected"):
    """A collector's data for the whole run, sent after the last step.

    name: the collector's name (the evidence field it fills).
    data: what its finish() returned."""

    name: str
    data: Any = None


class Ended(Record, tag="ended"):
    """How the run ended, seen from inside the child (a crash sends none: the parent tells it).

    status, step, exception, message, traceback, where: as auditor.evidence.model.Ending.
    backend_flags: the backend settings at the end (a completed run only).
    cuda_devices: every visible CUDA device, when the program initialised CUDA.
    audit_cause: as Ending's.
    notes: for the environment's notes: what the audit kept out of the program's output
    (auditor.capture.held_output, read wherever the child builds this record)."""

    status: str
    step: int | None = None
    exception: str | None = None
    message: str | None = None
    traceback: str | None = None
    where: Frame | None = None
    audit_cause: str | None = None
    notes: list[str] = msgspec.field(default_factory=held_output.notes)
    backend_flags: dict[str, Any] | None = None
    cuda_devices: list[dict[str, Any]] = []


class Outside(Record, tag="outside"):
    """What ran in a whole program outside its audited steps, sent when the stretch ended.

    phase: "between" (after an audited step, before the next) or "after" (after the last one);
    after_step: the audited step it follows; ms: its wall time; tallies: what the probes saw in it."""

    phase: str
    after_step: int | None = None
    ms: float = 0.0
    tallies: list[Tally] = []


class ProgramRun(Record, tag="program"):
    """How a whole program ran (`audit run file.py`, `-m pkg.mod`), sent before `ended`.

    run: how its steps were found and how it ended (auditor.evidence.model.Program)."""

    run: Program


AnyRecord = Union[Hello, UsageError, Setup, Step, GraphScan, Profile, Snapshot, Collected, Ended, Outside,
                  ProgramRun, DeviceTimes]

DECODER = msgspec.json.Decoder(AnyRecord)
_ENCODER = msgspec.json.Encoder()


def encode(record: Record) -> bytes:
    """One line of the stream (the record and its newline)."""
    return _ENCODER.encode(record) + b"\n"


class ChildRequest(msgspec.Struct, kw_only=True, frozen=True):
    """What the parent asks of the child (auditor.capture.runner.run_child), its one argv value.

    target: TARGET's spec; out: the run directory (absolute: the program may change directory);
    run_name: the profiler's logdir under out/tb; fd: the pipe the records go to; parent_pid: the
    parent, whose death ends the child; catch_sigterm: stop on SIGTERM as on Ctrl-C (not under a
    launcher); added_env: the variables the parent set for torch's logging, not the user's;
    script_args: the program's own arguments; options: `audit run`'s, whole."""

    target: str
    out: str
    run_name: str
    fd: int
    parent_pid: int | None = None
    catch_sigterm: bool = False
    added_env: tuple[str, ...] = ()
    script_args: tuple[str, ...] = ()
    options: RunOptions = RunOptions()


def encode_request(request: ChildRequest) -> str:
    return encode_json(request)


def decode_request(text: str) -> ChildRequest:
    return decode(text, ChildRequest)
