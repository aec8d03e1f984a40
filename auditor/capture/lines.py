"""Where a step's time goes, line by line: a sampler of the user's frames while steps run.

A daemon thread wakes every `INTERVAL_S` while a step runs, reads the stack of the thread running
the step (`sys._current_frames`), and charges the time since its last look to the innermost line
of the user's own code there (library frames below it are skipped: the line that called
`torch.cat` is charged for the cat). At the step's end the per-line times are handed over as
`line-time` tallies (count: samples, ms: time charged), beside the probes' tallies. A step that
slows down because of a line outside the probed phases (re-concatenating an ever-growing list)
shows its growth there: step-slowdown compares each line's time early and late in the run.

It reads frames only; the program's threads and values are never touched.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

from auditor.capture.frames import library_code
from auditor.evidence import model as m

INTERVAL_S = 0.002  # between looks at the step's stack: ~5 looks in a 10 ms step
ENABLED = os.environ.get("AUDITOR_LINE_SAMPLING", "1") != "0"
_ASYNC_SIGNALS = {getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2",
                                                     "SIGALRM", "SIGCHLD", "SIGWINCH", "SIGPIPE") if hasattr(signal, name)}


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
        f = frames().get(self.ident)
        while f is not None and library_code(f.f_code):
            f = f.f_back
        if f is None:
            self.last = now
            return
        key = (f.f_code.co_filename, f.f_lineno, f.f_code.co_name)
        # no frame is kept past its look: a frame keeps its locals (a loss and its graph) alive,
        # and the memory and graph-leak checks at the step's end would count them as held
        f = None
        c = self.counts.get(key)
        if c is None:
            c = self.counts[key] = [0, 0.0]
        c[0] += 1
        c[1] += (now - self.last) * 1e3
        self.last = now
