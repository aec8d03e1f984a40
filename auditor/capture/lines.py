"""Where a step's time goes, line by line: a sampler of the user's frames while steps run.

A daemon thread wakes every `INTERVAL_S` while a step runs, reads the stack of the step's thread
(`sys._current_frames`) and charges the time since its last look to the innermost line of the
user's own code there (the line that called `torch.cat` is charged for the cat). At the step's end
the per-line times are handed over as `line-time` tallies; step-slowdown compares each line's time
early and late in the run. It reads frames only.

Sampled steps (`Schedule`): every step of the first DENSE_STEPS, then one in EVERY (the first
unchecked, unprofiled step of each EVERY) AT_EACH_RATE times, then half as often, HALVINGS times
(capture.cadence). Each step's record says whether it was sampled (`lines_sampled`), and
step-slowdown reads lines over the sampled steps only.
A look's cost, measured: bench/HISTORY.md, "auditor/capture/lines.py".
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from functools import partial
from itertools import accumulate, chain, islice, repeat, takewhile
from operator import attrgetter, is_not, methodcaller
from typing import Any

from auditor.capture.cadence import due
from auditor.capture.frames import library_code, on_forget
from auditor.evidence import model as m

INTERVAL_S = 0.002  # between looks at the step's stack: ~5 looks in a 10 ms step
DENSE_STEPS = 40  # steps sampled from the start (every step of an audit of up to 40 steps)
EVERY = 16  # then one step in EVERY, AT_EACH_RATE times; then half as often, HALVINGS times
AT_EACH_RATE = 32
HALVINGS = 2
FIRST_LOOK = 8  # frames a look reads first; the rest of the stack only when those are all library code
ENABLED = os.environ.get("AUDITOR_LINE_SAMPLING", "1") != "0"
_ASYNC_SIGNALS = {getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2",
                                                     "SIGALRM", "SIGCHLD", "SIGWINCH", "SIGPIPE") if hasattr(signal, name)}


class Schedule:
    """Whether step i is sampled (see the module's docstring): `sampled(i, checked)`, asked once
    per unprofiled step, in step order; `checked`: the numerics checks run in step i."""

    def __init__(self, dense: int = DENSE_STEPS, every: int = EVERY) -> None:
        self.dense, self.every = dense, every
        self.owed = False  # an EVERY-th step was checked: the next unchecked one is sampled instead

    def sampled(self, i: int, checked: bool) -> bool:
        if i < self.dense:
            return True
        if due(i - self.dense, self.every, AT_EACH_RATE, HALVINGS):
            self.owed = True
        if self.owed and not checked:
            self.owed = False
            return True
        return False


class LineSampler:
    """Per-line time of the steps of one thread (the one that calls `resume`)."""

    def __init__(self, interval: float = INTERVAL_S) -> None:
        self.interval = interval
        self.ident: int | None = None
        self.counts: dict[tuple[str, int, str], list[float]] = {}  # (file, line, function) -> [samples, ms]
        self.running = threading.Event()
        # held while a sample looks at the step's frames: pause() waits for it, so the step's end
        # (the profiler's start and stop walk the threads' frames too) never runs beside a look
        self.looking = threading.Lock()
        self.thread: threading.Thread | None = None
        self.last = 0.0

    def resume(self) -> None:
        """A step begins on the calling thread: sample it."""
        self.ident = threading.get_ident()
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="auditor-line-sampler", daemon=True)
            self.thread.start()
        self.last = time.perf_counter()
        self.running.set()

    def pause(self) -> None:
        """The step ends: no sample is taken after this returns."""
        self.running.clear()
        with self.looking:
            pass

    def take(self) -> list[dict[str, Any]]:
        """The step's per-line times, as probe tallies (and the counts start again)."""
        counts, self.counts = self.counts, {}
        return [{"kind": m.LINE_TIME, "what": "the line's own time", "count": int(n), "ms": round(ms, 3), "data": {},
                 "where": {"file": f, "line": line, "function": fn}} for (f, line, fn), (n, ms) in counts.items()]

    def _run(self) -> None:
        # The process's signals are the program's: the kernel hands a signal to any thread that does
        # not block it, and one taken here would interrupt this thread's sleep while the main thread
        # slept on, its handler run later in the auditor's code, not at the user's line (a Ctrl-C or
        # SIGTERM ending then named no line)
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, _ASYNC_SIGNALS)
        frames, perf, wait = sys._current_frames, time.perf_counter, self.running.wait
        while True:
            wait()
            time.sleep(self.interval)
            with self.looking:
                if self.running.is_set():
                    self._look(frames, perf)

    def _look(self, frames, perf) -> None:
        """One sample: the line the step's thread is at is charged the time since the last."""
        now = perf()
        codes = _stack_codes(frames, self.ident, FIRST_LOOK)
        at = _first_user(codes)
        if at is None and len(codes) == FIRST_LOOK:  # (library code all the way down those: the rest)
            at = _first_user(_stack_codes(frames, self.ident, None))
        if at is None:
            self.last = now
            return
        code, lasti = at
        key = (code.co_filename, _line_at(code, lasti), code.co_name)
        c = self.counts.get(key)
        if c is None:
            c = self.counts[key] = [0, 0.0]
        c[0] += 1
        c[1] += (now - self.last) * 1e3
        self.last = now


def _stack_codes(frames, ident: int | None, depth: int | None) -> list[tuple[Any, int]]:
    """(code, f_lasti) of the innermost `depth` frames (None: all) of thread `ident`, innermost first,
    read in one statement whose frames live only inside C iterators consumed by one call, so this
    thread holds none of the program's frames once it could give the GIL to the program's thread.
    A frame held across such a switch could finish meanwhile: its locals outlive its return, and
    are freed here, in this thread, when let go. torch.compile drops the guard
    `torch.autograd.grad_mode._enter_inference_mode` returns and relies on its freeing to restore
    grad mode: freed here, it restored this thread's grad mode, not the program's, and dynamo
    raised "Global grad_mode state changed while dynamo tracing" in an audited compiled step (and
    a frame kept past its look keeps a loss and its graph alive for the step's memory checks)."""
    return list(map(_CODE_LASTI, islice(takewhile(_NOT_NONE, accumulate(
        chain(map(methodcaller("get", ident), map(_CALL, (frames,))), repeat("f_back")), getattr)), depth)))


# (id(code), f_lasti) -> (code, its line): a frame's f_lineno decodes its code's line table from the
# start at every read (~1-10 us in a long function: torch's optimizer and module code, a training
# loop's), where its offset is one field; a look needs the line of one frame only (_line_at)
_LINES: dict[tuple[int, int], tuple[Any, int | None]] = {}
_LINES_AT_MOST = 10_000  # places kept (code made anew at run time would grow it without end)
on_forget(_LINES.clear)


def _line_at(code: Any, lasti: int) -> int | None:
    """The line `code` is at when its frame's f_lasti is `lasti`: what the frame's f_lineno reads."""
    key = (id(code), lasti)
    hit = _LINES.get(key)
    if hit is not None and hit[0] is code:
        return hit[1]
    line = (next((n for start, end, n in code.co_lines() if start <= lasti < end), None) if lasti >= 0
            else code.co_firstlineno)
    if len(_LINES) >= _LINES_AT_MOST:
        _LINES.clear()
    _LINES[key] = (code, line)  # (the code kept with it: its id is not reused while it is here)
    return line


def _first_user(codes: list[tuple[Any, int]]) -> tuple[Any, int] | None:
    return next((c for c in codes if not library_code(c[0])), None)


_CALL = methodcaller("__call__")
_NOT_NONE = partial(is_not, None)
_CODE_LASTI = attrgetter("f_code", "f_lasti")
