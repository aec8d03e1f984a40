"""The parent side of `audit run`: start the child, read its evidence stream, survive its death.

The parent never imports the user's code. It ignores the first Ctrl-C (the child, in the same
process group, gets it too and reports what it was doing), and kills the child on the second.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import msgspec

from auditor.capture import wire
from auditor.capture.stream import read_chunks, read_records, split_lines, widen_pipe
from auditor.capture.target import Target, TargetError
from auditor.capture.window_memory import ChildMemory, cgroup_limit, out_of_memory_kill
from auditor.command_options import RunOptions
from auditor.evidence import model as m
from auditor.evidence import source_access
from auditor.evidence.frame import Frame, recorded_frame
from auditor.evidence.step_clock import DEVICE_CLOCK_NOTE
from auditor.evidence.whole_files import WholeFile, leftovers, remove_leftover

STDERR_TAIL_LINES = 40
STDERR_TAIL_LINE_BYTES = 4000  # the end of each (see pump_stderr)
# Kineto prints stage markers on every profiler start/stop whatever its log level; they are ours,
# not the user's, so they are cut out of the user's terminal (and the crash tail), also where one
# lands inside a line of the program's (after a progress bar's redraw, which ends in no newline).
# A CUDA build of torch on a machine without a GPU has kineto say so at the profiler's start (an
# ERROR line naming gpuGetDeviceCount): the audit's too, and nothing the user can act on.
PROFILER_NOISE = re.compile(rb"(?:USDT|STAGE):\d{4}-\d\d-\d\d \S+ \d+:\d+ \w+\.cpp:\d+\][^\n]*\n?|"
                            rb"ERROR:\d{4}-\d\d-\d\d \S+ \d+:\d+ DeviceProperties\.cpp:\d+\] gpuGetDeviceCount failed[^\n]*\n?|"
                            rb"\[W\d+ [\d:.]+ \d+ CPUAllocator\.cpp:\d+\] Memory block of unknown size[^\n]*\n?")
GRACE_AFTER_INTERRUPT_S = 15.0
QUIET_ENV = {"KINETO_LOG_LEVEL": "3", "TORCH_CPP_LOG_LEVEL": "ERROR"}  # set for the child (see run_child)
TEARDOWN_VAR = "TEARDOWN_CUPTI"  # set for a profiled child unless the user set it (see run_child)
# How run_child starts the child: subprocess.Popen, or what answers as one does (pid, poll, wait,
# send_signal, kill). The test suite's stands in with a process forked from one that has imported
# torch already (tests/zygote.py), whose children are the same code from the same state.
start_child: Callable[..., subprocess.Popen] = subprocess.Popen


@dataclass
class RunRequest:
    target: Target
    out_dir: Path
    options: RunOptions = RunOptions()  # `audit run`'s, passed on whole to the child
    script_args: tuple[str, ...] = ()  # the user's script's own arguments (its sys.argv[1:])
    catch_sigterm: bool = True  # False under a launcher, whose SIGTERM stops the ranks (auditor.launch)


def _tally(t: m.Tally) -> m.Tally:
    t.where = recorded_frame(t.where)
    return t


_FIELD_TYPES: dict[tuple[type, str], Any] = {}


def _collector_field(record: m.StepRecord | m.Evidence, name: str, data: Any) -> None:
    """Put a collector's data into the field of `record` named after the collector, converted to
    that field's type. Data of a collector the evidence has no field for is not kept (it is in
    records.jsonl): a collector's data is evidence once the model has a field for it."""
    key = (type(record), name)
    if key not in _FIELD_TYPES:
        _FIELD_TYPES[key] = next((f.type for f in msgspec.structs.fields(type(record)) if f.name == name), None)
    field_type = _FIELD_TYPES[key]
    if field_type is not None:
        setattr(record, name, msgspec.convert(data, type=field_type))


class EvidenceBuilder:
    """Turns stream records into Evidence as they arrive, so a dead child leaves complete state."""

    def __init__(self, request: RunRequest) -> None:
        self.ev = m.Evidence(source="run", target=request.target.spec, requested_steps=request.options.steps)
        self.usage_error: str | None = None
        self.ended = False
        self.pending_snapshots: list[str] = []
        self.out_dir = request.out_dir
        self.request = request
        self.set_up = False  # the module's setup code ran to its end (the steps began)
        self.unwritten_trace = ""  # the profiler's trace the child could not write (wire.Profile)

    def feed(self, r: wire.Record) -> None:
        ev = self.ev
        if isinstance(r, wire.Step):
            step = m.StepRecord(
                index=r.index, start_s=r.start_s, ms=r.ms, cpu_ms=r.cpu_ms, waited_ms=r.waited_ms,
                profiled=r.profiled, failed=r.failed,
                rss_bytes=r.rss_bytes, device_allocated=r.device_allocated, device_reserved=r.device_reserved,
                anomaly_enabled=r.anomaly_enabled, lines_sampled=r.lines_sampled, own_before_ms=r.own_before_ms,
                tallies=[_tally(t) for t in r.tallies])
            for name, data in r.collected.items():
                _collector_field(step, name, data)
            ev.steps.append(step)
            self._loaders(r.dataloaders)
        elif isinstance(r, wire.Hello):
            ev.environment = r.environment
        elif isinstance(r, wire.UsageError):
            self.usage_error = r.message
        elif isinstance(r, wire.Setup):
            # (a second Setup is more of it: the passes a program ran before its loop's first fetch)
            ev.setup = [*ev.setup, *(_tally(t) for t in r.tallies)] if self.set_up else [_tally(t) for t in r.tallies]
            self.set_up = True
            ev.environment.backend_flags = r.backend_flags
            if r.num_threads:  # (as the user's setup left it: torch.set_num_threads(1) at import)
                ev.environment.num_threads = r.num_threads
            self._loaders(r.dataloaders)
        elif isinstance(r, wire.GraphScan):
            ev.graph_scans.append(m.GraphScan(
                after_step=r.after_step, tensors=r.tensors, graph_nodes=r.graph_nodes, failed=r.failed,
                holders=[{**h, "where": msgspec.to_builtins(recorded_frame(h.get("where")))} for h in r.holders]))
        elif isinstance(r, wire.Profile):
            ev.profile = m.ProfileWindow(steps=r.steps, trace_files=r.trace_files, top_ops=r.top_ops, cut=r.cut,
                                         trace_bytes=r.trace_bytes, drop=r.drop)
            ev.traces = list(r.trace_files)
            ev.snapshots.extend(r.snapshots)
            self.unwritten_trace = r.unwritten
            ev.environment.notes.extend(r.notes)
        elif isinstance(r, wire.DeviceTimes):  # the device's clock of steps already recorded
            by_index = {s.index: s for s in ev.steps}
            for i, ms in zip(r.steps, r.ms):
                if i in by_index:
                    by_index[i].device_ms = ms
            if r.note:
                ev.environment.notes.append(f"{DEVICE_CLOCK_NOTE} {r.note}")
        elif isinstance(r, wire.Snapshot):  # the OOM observer's snapshot: listed only once it exists on disk
            self.pending_snapshots.append(r.path)
        elif isinstance(r, wire.Collected):
            _collector_field(ev, r.name, r.data)
        elif isinstance(r, wire.Outside):  # a whole program's stretch outside its steps
            ev.outside.append(m.Outside(phase=r.phase, after_step=r.after_step, ms=r.ms,
                                        tallies=[_tally(t) for t in r.tallies]))
        elif isinstance(r, wire.ProgramRun):
            ev.program = r.run
            ev.environment.notes.append(f"steps: {ev.program.steps_found}")
        elif isinstance(r, wire.Ended):
            self.ended = True
            if r.backend_flags is not None:
                ev.environment.backend_flags = r.backend_flags
            if r.cuda_devices:
                ev.environment.cuda_devices = r.cuda_devices
            ev.environment.notes.extend(r.notes)
            ev.ending = m.Ending(status=r.status, step=r.step, exception=r.exception, message=r.message,
                                 traceback=r.traceback, where=recorded_frame(r.where), audit_cause=r.audit_cause)

    def _loaders(self, loaders: list[m.DataLoaderInfo]) -> None:
        for d in loaders:
            d.where = recorded_frame(d.where)
            self.ev.dataloaders.append(d)

    def finish(self, returncode: int, stderr_tail: str, memory: ChildMemory | None = None) -> m.Evidence:
        ev = self.ev
        ev.snapshots.extend(p for p in self.pending_snapshots if (self.out_dir / p).is_file())
        if not self.ended:
            sig = None
            if returncode < 0:
                try:
                    sig = signal.Signals(-returncode).name
                except ValueError:
                    sig = str(-returncode)
            last = ev.steps[-1].index + 1 if ev.steps else 0
            in_step = last if last < ev.requested_steps else None
            if returncode == 0 and self.set_up and in_step is not None:
                # `os._exit(0)` in a step: the program stopped itself with success, without the
                # clean-up sys.exit(0) does; as sys.exit(0), not a failure
                ev.ending = m.Ending(status="exited", step=in_step, returncode=0,
                                     message=f"the program ended its process with exit code 0 during step "
                                             f"{in_step} (os._exit(0)), as it would without the audit")
            else:
                how = f"killed by {sig}" if sig else f"exited with code {returncode} without finishing"
                during = f" during step {in_step}" if in_step is not None else ""
                if sig == "SIGKILL" and memory is not None:
                    how, during = self._kill_phrase(memory, in_step, during)
                ev.ending = m.Ending(status="crashed", step=in_step,
                                     message=f"the audited process {how}{during}",
                                     returncode=returncode, signal=sig, where=crash_frame(stderr_tail))
        else:
            ev.ending.returncode = returncode
        if ev.ending.status != "completed":
            ev.ending.stderr_tail = stderr_tail or None
        return ev


    def _kill_phrase(self, memory: ChildMemory, in_step: int | None, during: str) -> tuple[str, str]:
        """A SIGKILL the audit did not send, with what the parent's samples of the child's memory say
        of it: the kernel's out-of-memory killer when memory was all but gone (window_memory)."""
        why = out_of_memory_kill(memory.peak, memory.last, memory.available, memory.total, cgroup_limit())
        facts = [f"at {memory.peak / 1e9:.1f} GB resident"] if memory.peak else []
        if in_step is not None and self.request.options.profile:
            from auditor.capture.child import profile_plan

            warm, active = profile_plan(self.request.options.steps)
            if in_step in ([warm] if warm is not None else []) + active:
                facts.insert(0, "in the profiler window")
        if why:
            return "was killed by the kernel's out-of-memory killer", f"{during}, {', '.join(facts)} (SIGKILL; {why})"
        return "killed by SIGKILL", during + (f" ({', '.join(facts)})" if facts else "")


def interrupted_message(signals: list[str], killed: bool) -> str:
    """How a run the program did not report the end of was interrupted: the signals `audit` got, in
    order (each named once, by its name: SIGINT is a Ctrl-C), and the kill that ended the program."""
    named = list(dict.fromkeys(signals))
    how = named[0] + "".join(f", then {s}" for s in named[1:])
    return f"interrupted ({how}{'; the audit killed the program (SIGKILL)' if killed else ''})"


_FAULT_FRAME = re.compile(r'^\s*File "(.+)", line (\d+) in (\S+)', re.M)


def crash_frame(stderr_tail: str) -> Frame | None:
    """The user's line in faulthandler's dump of a crash (a segfault in an extension called from
    the step): its most recent frame outside torch, the auditor and installed packages."""
    from auditor.capture.frames import is_library

    for file, line, function in _FAULT_FRAME.findall(stderr_tail or ""):
        if not is_library(file):
            return recorded_frame({"file": file, "line": line, "function": function})
    return None


def _stderr_channel(forward_stderr: bool) -> tuple[int, int]:
    """(the child's stderr, the fd its output is read from). The child's stderr goes through
    `audit` (forwarded, its last lines kept for a crash's report, the profiler's stage markers
    dropped). When `audit`'s own stderr is a terminal and is forwarded to, it is a pseudo-terminal,
    so the program sees a terminal as in a plain run (`sys.stderr.isatty()`: progress bars redraw
    in place, colours stay on), sized as `audit`'s; its output post-processing (ONLCR) is off, so
    each "\n" is forwarded as written and the terminal turns it into a line break as before.
    Otherwise a pipe, as `audit`'s stderr is then."""
    tty = False
    try:
        tty = forward_stderr and os.isatty(sys.stderr.fileno())
    except (AttributeError, ValueError, OSError):  # (a replaced sys.stderr without a descriptor)
        pass
    if tty:
        try:
            import fcntl
            import pty
            import termios

            master, slave = pty.openpty()
        except (ImportError, OSError):  # (no pseudo-terminals here: a pipe)
            pass
        else:
            try:
                attrs = termios.tcgetattr(slave)
                attrs[1] &= ~termios.ONLCR
                termios.tcsetattr(slave, termios.TCSANOW, attrs)
                size = fcntl.ioctl(sys.stderr.fileno(), termios.TIOCGWINSZ, b"\0" * 8)
                fcntl.ioctl(slave, termios.TIOCSWINSZ, size)
            except OSError:
                pass
            return slave, master
    r, w = os.pipe()
    return w, r


def child_environment(environ: Mapping[str, str], profile: bool) -> tuple[dict[str, str], list[str]]:
    """The child's environment made from `environ` (the audit's), and the names in it the audit
    added for torch's logging (which the child removes once torch has read them)."""
    # Kineto's own log lines would drown the user's output; their errors still show. The child
    # removes the variables it did not inherit from the user once torch has read them, so the
    # program (and what it starts) sees the environment it was given.
    env = dict(environ)
    env.pop(source_access.ENV, None)  # (the audit's own setting, not the program's environment)
    if profile:
        # Kineto keeps CUPTI subscribed after a profiler session ends unless TEARDOWN_CUPTI=1
        # (pytorch/pytorch#144455, #146604): every kernel the program launches after the window
        # would pay for it (H100, a host-bound encoder: 31.4 ms/step after the window, 21.25 with
        # it set). Set for the child, where the program keeps it; a value the user gave is kept,
        # and torch's own "0" for CUDA graphs (set as it compiles them) still wins.
        env.setdefault(TEARDOWN_VAR, "1")
    added = [name for name in QUIET_ENV if name not in env]
    env.update({name: QUIET_ENV[name] for name in added})
    return env, added


def run_child(request: RunRequest, on_record: Callable[[wire.Record], None] | None = None,
              forward_stderr: bool = True) -> m.Evidence:
    """Run the target in a child process and return the evidence it streamed, however it ended.

    Raises TargetError when the child reports a problem with TARGET itself."""
    request.out_dir.mkdir(parents=True, exist_ok=True)
    # (an earlier run's traces in DIR/tb are removed once this run's evidence replaces the earlier
    # one's, and only those it named: auditor.app.finish)
    proc, read_fd, err_read = _start(request, forward_stderr)
    pump = StderrPump(err_read, proc, forward_stderr)
    interrupts = Interrupts(proc)
    with interrupts.caught(request.catch_sigterm):
        builder = EvidenceBuilder(request)
        memory = ChildMemory(proc.pid)
        raw = RawCopy(request.out_dir / "records.jsonl")
        try:
            for record, line in read_records(read_chunks(read_fd, proc)):
                raw.write(line, begun=not isinstance(record, (wire.Hello, wire.UsageError)))
                builder.feed(record)
                if on_record is not None:
                    on_record(record)
            returncode = proc.wait()
            pump.finish()
        finally:
            raw.close(keep=builder.usage_error is None)
            memory.stop()
            os.close(read_fd)
            pump.close()
    if builder.usage_error is not None:  # (nothing ran: no records.jsonl of this run's, see RawCopy)
        raise TargetError(builder.usage_error)
    killed_by_audit = interrupts.killed_by_audit()
    interrupts.label_ending(builder, killed_by_audit and returncode < 0)
    evidence = builder.finish(returncode, pump.text(), None if killed_by_audit else memory)
    if evidence.profile is not None:  # (the window's bound is judged by what the kernel counted, not the child's word)
        evidence.profile.peak_rss_bytes = memory.peak_bytes()
    _note_unwritten(evidence, raw, request, builder, proc.pid)
    return evidence


def _start(request: RunRequest, forward_stderr: bool) -> tuple[subprocess.Popen, int, int]:
    """The child, started with its request (wire.ChildRequest, its one argv value): (the process,
    the read end of its record pipe, the descriptor its stderr is read from)."""
    read_fd, write_fd = os.pipe()
    widen_pipe(write_fd)
    env, added = child_environment(os.environ, request.options.profile)
    # (out absolute: the user's code may change directory before the profiler writes there)
    child = wire.ChildRequest(target=request.target.spec, out=str(request.out_dir.absolute()),
                              run_name=request.target.name, fd=write_fd, parent_pid=os.getpid(),
                              catch_sigterm=request.catch_sigterm, added_env=tuple(added),
                              script_args=tuple(request.script_args), options=request.options)
    cmd = [sys.executable, "-m", "auditor.capture.child", wire.encode_request(child)]
    err_write, err_read = _stderr_channel(forward_stderr)
    try:
        proc = start_child(cmd, pass_fds=(write_fd,), stderr=err_write, env=env)
    except BaseException:
        os.close(err_read)
        raise
    finally:
        os.close(write_fd)
        os.close(err_write)
    return proc, read_fd, err_read


class StderrPump:
    """The child's stderr, forwarded to `audit`'s as it comes (redraws too: a bar shows live, and an
    endless one is never held whole), the profiler's stage markers cut out, its last lines kept for
    a crash's report."""

    def __init__(self, fd: int, proc: subprocess.Popen, forward: bool) -> None:
        self.fd, self.proc, self.forward = fd, proc, forward
        self.tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
        # whether the program's last line on stderr ends in no newline: the tail's last entry is a
        # progress bar's redraw (see split_lines), and the audit's own lines must begin a line of their own
        self.redraw = False
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        for line in split_lines(read_chunks(self.fd, self.proc, pause_s=0), redraws=True):
            if b".cpp:" in line:
                line = PROFILER_NOISE.sub(b"", line)
                if not line:
                    continue
            if self.forward:
                sys.stderr.buffer.write(line)
                sys.stderr.buffer.flush()
            if self.redraw:
                self.tail.pop()
            self.redraw = not line.endswith(b"\n")
            self.tail.append(line[-STDERR_TAIL_LINE_BYTES:].decode("utf-8", "replace"))

    def finish(self) -> None:
        """The child has exited: the rest of its stderr, and a line's end after its last redraw."""
        self.thread.join(timeout=5)
        if self.forward and self.redraw and not self.thread.is_alive():
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.buffer.write(b"\n")
                sys.stderr.buffer.flush()

    def close(self) -> None:
        if not self.thread.is_alive():
            os.close(self.fd)

    def text(self) -> str:
        return "".join(self.tail)


class Interrupts:
    """The signals that reached `audit` while the child ran, in order: the ending is labelled by the
    first (a SIGINT that a later SIGTERM cut short was still a SIGINT), and says when the audit
    killed the program. The child, in the same process group, gets a Ctrl-C too; a second one kills
    it, and so does GRACE_AFTER_INTERRUPT_S passing after the first."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.by: list[str] = []
        self.at = 0.0

    def on_sigint(self, signum: int, frame: Any) -> None:
        self.by.append(signal.Signals(signum).name)
        self.at = time.monotonic()
        if len(self.by) >= 2:
            self.proc.kill()

    def on_sigterm(self, signum: int, frame: Any) -> None:  # stop the child as Ctrl-C does; the report is still written
        if not self.by and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.on_sigint(signum, frame)

    def _watchdog(self, stop: threading.Event) -> None:  # after one Ctrl-C, give the child a grace period, then stop it
        while not stop.wait(0.5):
            if self.by and time.monotonic() - self.at > GRACE_AFTER_INTERRUPT_S:
                self.proc.kill()
                return

    @contextlib.contextmanager
    def caught(self, catch_sigterm: bool) -> Iterator[None]:
        """The handlers (on the main thread; SIGTERM's unless under a launcher) and the watchdog."""
        main_thread = threading.current_thread() is threading.main_thread()
        old = signal.signal(signal.SIGINT, self.on_sigint) if main_thread else None
        old_term = signal.signal(signal.SIGTERM, self.on_sigterm) if main_thread and catch_sigterm else None
        stop = threading.Event()
        threading.Thread(target=self._watchdog, args=(stop,), daemon=True).start()
        try:
            yield
        finally:
            stop.set()
            if main_thread:
                signal.signal(signal.SIGINT, old)
                if old_term is not None:
                    signal.signal(signal.SIGTERM, old_term)

    def killed_by_audit(self) -> bool:
        return len(self.by) >= 2 or bool(self.by and time.monotonic() - self.at > GRACE_AFTER_INTERRUPT_S)

    def label_ending(self, builder: EvidenceBuilder, killed: bool) -> None:
        """A run the signals stopped ended interrupted (`killed`: by the audit's kill), whether the
        program reported its end or not."""
        if not self.by:
            return
        ev = builder.ev
        if not builder.ended:
            builder.ended = True
            last = ev.steps[-1].index + 1 if ev.steps else None
            ev.ending = m.Ending(status="interrupted", step=last, signal=self.by[0],
                                 message=interrupted_message(self.by, killed))
        elif ev.ending is not None and ev.ending.status == "raised":
            # the program raised as the signal stopped it (a DataLoader whose workers the same SIGTERM
            # killed, a handler of its own that raises): the run was stopped, not failed by itself
            e = ev.ending
            e.status, e.signal = "interrupted", self.by[0]
            raised = f"{e.exception}: {(e.message or '').strip()}" if e.exception else (e.message or "").strip()
            e.message = f"stopped by {self.by[0]} sent to the audit; as it stopped, the program raised {raised}"


def _note_unwritten(evidence: m.Evidence, raw: RawCopy, request: RunRequest, builder: EvidenceBuilder,
                    pid: int) -> None:
    """The run's own files that could not be written whole (a full disk): named on stderr, in the
    evidence's notes and in its UNWRITTEN list, and removed."""
    lost = evidence.__dict__.setdefault(UNWRITTEN, [])
    if raw.error is not None:
        lost.append("records.jsonl")
        print(f"audit: warning: could not write records.jsonl: {raw.error}", file=sys.stderr)
        evidence.environment.notes.append(
            f"records.jsonl (the raw record stream) could not be written whole ({raw.error}): it was "
            f"removed; the evidence read from the stream is whole")
    # the child writes each file to a temporary name of its own, then renames it: one left behind
    # (the child killed meanwhile, a full disk) was not written whole, and would only take the room
    # the outputs need. The trace's are named as lost; only this child's are removed.
    if builder.unwritten_trace:  # (the child removed what it had written of it; why is in top_ops)
        lost.append(f"the profiler's trace ({builder.unwritten_trace})")
        why = evidence.profile.top_ops[0]["name"] if evidence.profile and evidence.profile.top_ops else ""
        print(f"audit: warning: could not write the profiler's trace {why}".rstrip(), file=sys.stderr)
    logdir = request.out_dir / "tb" / request.target.name
    for partial in [*leftovers(logdir, pid), *leftovers(request.out_dir, pid)]:
        if partial.parent == logdir and not partial.is_dir():
            lost.append(f"the profiler's trace ({partial.relative_to(request.out_dir)})")
            print(f"audit: warning: could not write the profiler's trace {partial.name} whole: removed",
                  file=sys.stderr)
            evidence.environment.notes.append(
                f"the profiler's trace could not be written whole (a full disk?): its partial file "
                f"{partial.name} was removed, and the rules that read the trace were skipped")
        remove_leftover(partial)


# Evidence.__dict__ key: the files of the run's own that could not be written (a full disk), for
# the terminal's "not written" line (auditor.app.finish)
UNWRITTEN = "unwritten"


class RawCopy:
    """records.jsonl, the stream's raw copy, written as it comes: to a file of its own made beside it
    (auditor.evidence.whole_files: never through a planted link), which becomes records.jsonl once
    the run has begun (`begun`: a record after the child's hello), so that a usage error leaves an
    earlier run's records.jsonl as it was. A write that fails (a full disk) ends the copy and
    removes it -- half a stream would read as a run that ended early -- while the records go on
    being read into the evidence; `error` says why it was lost."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.error: str | None = None
        self._f: WholeFile | None = None
        try:
            self._f = WholeFile(path)
        except OSError as e:
            self.error = e.strerror or str(e)

    def write(self, line: bytes, begun: bool = True) -> None:
        if self._f is None:
            return
        try:
            self._f.write(line)
            if begun:
                self._f.publish()
        except OSError as e:
            self.error = e.strerror or str(e)
            self._f.discard()
            self._f = None

    def close(self, keep: bool = True) -> None:
        """Done: kept as records.jsonl when `keep` (the run began), else removed."""
        if self._f is None:
            return
        f, self._f = self._f, None
        if not keep:
            f.discard()
            return
        try:
            f.commit(sync=False)
        except OSError as e:
            self.error = self.error or e.strerror or str(e)
            f.discard()
