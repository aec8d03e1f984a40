"""The device's clock of each step: CUDA events recorded at the step's boundaries, read once done.

A GPU-bound step is issued by the host in a fraction of the time the device takes to run it (an
8-layer, 4096-wide MLP: 2.4 ms queued, 63.7 ms run), so the host's clock alone reports the queueing
speed. At each step's beginning and end an event is recorded on the stream the step runs on (the
current stream then); the step's device time is the time between the two on the device. Events
are only queried, never waited for, inside the run: a step's time is read at a later step's end,
once its end event has completed, and at the run's end the rest is waited for by polling, for at
most FINISH_WAIT_S. A step whose events did not complete by then (a hung kernel), or that began on
one stream and ended on another (the device time between two streams' events is not the step's),
stays on the host's clock, and the run's evidence says so; so does a step whose boundary falls
inside the program's capture of a CUDA graph (no event is recorded into a capture).

The device is reached through a Marks interface (record, done, elapsed, stream of a mark), so the
CPU tests drive the same bookkeeping with a clock of their own; CudaMarks is the real one.
"""
from __future__ import annotations

import time
from typing import Any, Protocol

FINISH_WAIT_S = 5.0  # at the run's end: how long the last steps' events are polled for
POLL_S = 0.002


class Capturing(Exception):
    """The stream is capturing a CUDA graph: no mark may be recorded into it."""


class Marks(Protocol):
    def record(self) -> Any: ...  # a mark on the current stream, now in its queue
    def done(self, mark: Any) -> bool: ...  # the device has passed it (a query, never a wait)
    def elapsed_ms(self, start: Any, end: Any) -> float: ...  # device time between two done marks
    def stream(self, mark: Any) -> Any: ...  # the stream it was recorded on


class CudaMarks:
    """torch.cuda.Events with timing, on the current stream."""

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def record(self) -> Any:
        if self.torch.cuda.is_current_stream_capturing():
            # (an event recorded into a CUDA graph's capture would break the program's capture)
            raise Capturing("the step's stream was capturing a CUDA graph")
        stream = self.torch.cuda.current_stream()
        event = self.torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return (event, (stream.device_index, stream.cuda_stream))

    def done(self, mark: Any) -> bool:
        return mark[0].query()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return float(start[0].elapsed_time(end[0]))

    def stream(self, mark: Any) -> Any:
        return mark[1]


def cuda_in_use() -> bool:
    """A real CUDA device that the program has initialised (the auditor's own calls get the real
    answers under a CUDA rehearsal: auditor.capture.rehearsal.device.caller_is_user)."""
    import torch

    try:  # (a CPU build has no CUDA events, whatever a stand-in torch.cuda answers)
        # (is_initialized first: a flag, asked at every step's boundaries)
        return torch.cuda.is_initialized() and hasattr(torch._C, "_CudaEventBase") and torch.cuda.is_available()
    except Exception:
        return False


class DeviceClock:
    """Marks at each step's boundaries and the device times read from them.

    begin(i)/end(i) at the step's boundaries (cheap: two event records a step); take() returns the
    (step, ms) pairs completed since the last call; finish() waits (polling) for the rest and
    returns them with a note on the steps left on the host's clock."""

    def __init__(self, marks: Marks | None = None, active: Any = cuda_in_use) -> None:
        self.marks = marks
        self.active = active  # () -> bool: whether there is a device to clock now
        self.open: tuple[int, Any] | None = None
        self.pending: list[tuple[int, Any, Any]] = []  # (step, start, end), in order
        self.switched: list[int] = []  # steps that ended on another stream than they began on
        self.capturing: list[int] = []  # steps that began or ended inside a CUDA graph's capture
        self.failed = False  # the device's events could not be used at all (an error of ours)

    def _marks(self) -> Marks | None:
        if self.failed:
            return None
        if self.marks is None:
            if not self.active():
                return None
            self.marks = CudaMarks()
        return self.marks

    def begin(self, i: int) -> None:
        self.open = None
        try:
            marks = self._marks()
            if marks is not None:
                self.open = (i, marks.record())
        except Capturing:
            self.capturing.append(i)
        except Exception:
            self.failed = True

    def end(self, i: int) -> None:
        opened, self.open = self.open, None
        if opened is None or opened[0] != i:
            # (the device came into use during the step: the first step that begins with it is clocked)
            return
        try:
            marks = self._marks()
            if marks is None:
                return
            try:
                end = marks.record()
            except Capturing:
                self.capturing.append(i)
                return
            if marks.stream(end) != marks.stream(opened[1]):
                self.switched.append(i)
            else:
                self.pending.append((i, opened[1], end))
        except Exception:
            self.failed = True

    def take(self) -> list[tuple[int, float]]:
        """Device times of the steps whose end mark has completed, in step order."""
        out: list[tuple[int, float]] = []
        try:
            while self.pending and self.marks is not None and self.marks.done(self.pending[0][2]):
                i, start, end = self.pending.pop(0)
                out.append((i, round(self.marks.elapsed_ms(start, end), 3)))
        except Exception:
            self.failed = True
            self.pending.clear()
        return out

    def finish(self, wait_s: float = FINISH_WAIT_S) -> tuple[list[tuple[int, float]], str]:
        """The rest of the device times, polled for at most `wait_s`, and a note ("" when every
        clocked step was read) naming the steps that stay on the host's clock and why."""
        out = self.take()
        deadline = time.monotonic() + wait_s
        while self.pending and not self.failed and time.monotonic() < deadline:
            time.sleep(POLL_S)
            out += self.take()
        notes = []
        if self.pending:
            steps = [i for i, _, _ in self.pending]
            notes.append(f"the device had not finished {_steps(steps)} {wait_s:g} s after the run's last step "
                         f"(a kernel still running or hung): those step(s) are on the host's clock")
            self.pending.clear()
        if self.switched:
            notes.append(f"{_steps(self.switched)} ended on another CUDA stream than they began on: those "
                         f"step(s) are on the host's clock")
        if self.capturing:
            notes.append(f"{_steps(self.capturing)} began or ended while the program captured a CUDA graph: "
                         "those step(s) are on the host's clock")
        if self.failed:
            notes.append("the device's events could not be read: steps are on the host's clock")
        return out, "; ".join(notes)


def _steps(steps: list[int]) -> str:
    if len(steps) <= 4:
        return "step(s) " + ", ".join(map(str, steps))
    return f"{len(steps)} steps ({steps[0]}-{steps[-1]})"
