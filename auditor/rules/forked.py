"""Judge the rules in two processes when the evidence holds a large trace.

The rules are independent, and on a trace of millions of events they take about a third of
`audit analyze`'s time on one core. They come in units (a rule, or the rules sharing derived
evidence: `Rule.shares`); this process takes units from the front of the list and a forked copy
from its back, one at a time, until they meet (a two-ended queue in shared memory). The fork sends
its outcomes back through a pipe (a pickle from a copy of this process, never from elsewhere), and
the caller applies every outcome in the rules' order: the results are those of one process. The
fork also makes what the caller asks of it once its share is judged (`then`: the trace's efficiency
the reports read). A fork that fails, dies or has not reported FORK_WAIT_S (or 4 times this
process's share's time) after this process finished is killed, and this process judges what it
did not report.
When: on Linux, with more than one usable core, no other Python thread, and traces of at least
FORK_MIN_EVENTS events in all.
"""
from __future__ import annotations

import mmap
import multiprocessing
import os
import pickle
import select
import signal
import struct
import time
from typing import Any, Callable, TypeVar

from auditor.evidence.model import Evidence
from auditor.evidence.trace.parallel import forkable_cores

FORK_MIN_EVENTS = 500_000
FORK_WAIT_S = 60.0

T = TypeVar("T")


def worth_forking(evidence: Evidence, min_events: int = FORK_MIN_EVENTS) -> bool:
    """Whether to judge the rules in two processes (module docstring)."""
    return forkable_cores() >= 2 and sum(len(t.events) for t in evidence.trace_data) >= min_events


class _Queue:
    """Indexes 0..n-1 taken from both ends by two processes: `front` and `back` in shared memory."""

    def __init__(self, n: int) -> None:
        self.memory = mmap.mmap(-1, 16)
        self.memory[:] = struct.pack("qq", 0, n - 1)
        self.lock = multiprocessing.get_context("fork").Lock()

    def take(self, from_back: bool) -> int | None:
        with self.lock:
            front, back = struct.unpack("qq", self.memory[:])
            if front > back:
                return None
            if from_back:
                self.memory[8:] = struct.pack("q", back - 1)
                return back
            self.memory[:8] = struct.pack("q", front + 1)
            return front


def units(ids: list[str], shares: Callable[[str], tuple[str, ...]]) -> list[list[str]]:
    """The ids in units: those sharing any name in `shares(id)` together (at the first one's place),
    each other id alone."""
    out: list[list[str]] = []
    unit_of: dict[str, list[str]] = {}
    for i in ids:
        unit = next((unit_of[name] for name in shares(i) if name in unit_of), None)
        if unit is None:
            unit = []
            out.append(unit)
        unit.append(i)
        for name in shares(i):
            unit_of.setdefault(name, unit)
    return out


def judge_forked(groups: list[list[str]], judge: Callable[[str], T],
                 then: Callable[[], Any] | None = None) -> tuple[dict[str, T], Any]:
    """judge(id) for every id of every unit, in this process and a forked one (module docstring),
    and what `then()` returned in the fork once its share was judged (None when it did not report:
    `then` is for evidence made while this process judges its last rules, which is then made here
    when it is read)."""
    ids = [i for unit in groups for i in unit]
    queue = _Queue(len(groups))
    read_end, write_end = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(read_end)
        os.close(write_end)
        return {i: judge(i) for i in ids}, None
    if pid == 0:  # the fork: judge from the back, send what it found, leave without any exit work
        status = 1
        try:
            os.close(read_end)
            theirs = {}
            while (k := queue.take(from_back=True)) is not None:
                theirs.update((i, judge(i)) for i in groups[k])
            made = _made(then)
            with os.fdopen(write_end, "wb") as pipe:
                pipe.write(pickle.dumps((theirs, made), protocol=pickle.HIGHEST_PROTOCOL))
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    started = time.monotonic()
    mine: dict[str, T] = {}
    while (k := queue.take(from_back=False)) is not None:
        mine.update((i, judge(i)) for i in groups[k])
    sent = _read_until(read_end, pid, max(FORK_WAIT_S, 4 * (time.monotonic() - started)))
    _, status = os.waitpid(pid, 0)
    theirs: dict[str, T] = {}
    made = None
    if status == 0 and sent:
        try:
            theirs, made = pickle.loads(sent)
        except Exception:  # (a cut-short pickle: judged here below)
            theirs, made = {}, None
    for i in ids:  # what the fork took and did not report
        if i not in mine and i not in theirs:
            mine[i] = judge(i)
    return {i: mine[i] if i in mine else theirs[i] for i in ids}, made


def _made(then: Callable[[], Any] | None) -> Any:
    """then(), or None when there is none or it raised (it is then made where it is read)."""
    try:
        return None if then is None else then()
    except Exception:  # noqa: BLE001
        return None


def _read_until(read_end: int, pid: int, wait_s: float) -> bytes:
    """Everything the fork writes to the pipe until it closes it; b"" when it has not within
    `wait_s` (then it is killed)."""
    chunks: list[bytes] = []
    deadline = time.monotonic() + wait_s
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read_end], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                return b""
            data = os.read(read_end, 1 << 20)
            if not data:
                return b"".join(chunks)
            chunks.append(data)
    finally:
        os.close(read_end)
