"""The profiler window's memory bound: what the audit adds to the process must not threaten the machine.

torch.profiler with shapes, stacks and memory keeps every event of the window in the process until
the window ends: a program that makes many small calls per step (LBFGS's 20 closure calls) can grow
by gigabytes a step (time_sequence_prediction: 0.67 GB plainly, 24 GB in its profiled steps, then
the kernel's out-of-memory killer). While the window records, the process's resident memory
is read at each backward pass's start and each step's end; once it has grown past the bound, the
window ends there, keeping what it recorded.

The bound: the window may add at most AUDITOR_PROFILE_MEMORY_GIB (`audit run --profile-memory`),
by default half the memory the machine had available when the window started, to the resident
memory the process had then, its end included: stopping the profiler processes and exports what it
recorded, which takes about as much again and more (time_sequence_prediction, window cut at +2.46 GB:
+5.64 GB at the stop's peak), so the recording itself is cut at the bound over END_FACTOR.
"""
from __future__ import annotations

import os
import threading

import psutil

from auditor.evidence.model import WindowCut

GiB = 1 << 30
ENV = "AUDITOR_PROFILE_MEMORY_GIB"
END_FACTOR = 2.5  # a window's peak growth, its end included, over its growth while it recorded (2.29 measured)


def allowed_growth(available: int) -> int:
    """Bytes the window may add: the user's bound, else half of what was available."""
    try:
        gib = float(os.environ.get(ENV, ""))
    except ValueError:
        gib = 0.0
    return int(gib * GiB) if gib > 0 else available // 2


class Guard:
    """Reads the process's resident memory at each point the window may end (a backward pass
    starting, a step ending: ~2 us a read) while the window records."""

    def __init__(self) -> None:
        from auditor.capture.session import rss_bytes  # (the child's: the parent imports no torch)

        self._rss = rss_bytes
        self.start_rss = rss_bytes() or 0
        self.limit = self.start_rss + int(allowed_growth(psutil.virtual_memory().available) / END_FACTOR)
        self.peak = self.start_rss

    def over(self) -> bool:
        rss = self._rss() or 0
        self.peak = max(self.peak, rss)
        return rss > self.limit

    def cut(self, step: int) -> WindowCut:
        return WindowCut(step=step, rss_bytes=self.peak, start_rss_bytes=self.start_rss, limit_bytes=self.limit)


class ChildMemory:
    """The audited process's resident memory, sampled by the parent while it runs: what a kill by
    the kernel's out-of-memory killer leaves as evidence (the child cannot report its own SIGKILL)."""

    def __init__(self, pid: int, every_s: float = 0.25) -> None:
        self.peak = self.last = 0
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
            if self._done.wait(self._every):
                return

    def stop(self) -> None:
        self._done.set()


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
