"""One audited step's machinery in the child: what runs at its beginning and at its end.

`StepSession.begin(i)` starts the profiler window when step i is its first, tells the collectors,
and takes the step's start times; `StepSession.end(i)` takes its end times, advances the profiler,
sends the step's record (times, memory, the probes' tallies, the collectors' data, new DataLoaders)
and runs the graph scan planned after step i. Both the step-function mode (child.run calls the
step between them) and the script mode (capture.steps calls them from the program's own loop)
use it, so a step is measured the same way in both.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch

from auditor.capture import graphs, lines, own_fds, probes, run_queue, this_process, wire
from auditor.capture.probes import graph_use
from auditor.capture.bench_switches import OFF, TOGGLED, off
from auditor.capture.device_clock import DeviceClock
from auditor.capture.numerics.schedule import dense_steps, timed_block
from auditor.capture.unseen import dynamo_skips_our_frames


class StepSession:
    """The per-step state of one run.

    out: the evidence Writer; rec: the probes' Recorder; prof: the child's Profiler (window by
    step index); collectors: the loaded collectors; scans: step indices after which the graph scan
    runs; scan_target: returns (module, source file, step line span) for that scan, read when it
    runs (a script's `__main__` exists only while it runs)."""

    def __init__(self, out: Any, rec: probes.Recorder, prof: Any, collectors: list, scans: set[int],
                 scan_target: Callable[[], tuple[Any, str | None, Any]]) -> None:
        self.out = out
        self.rec = rec
        self.prof = prof
        self.collectors = collectors
        self.scans = scans if "scans" not in OFF else set()  # (OFF: bench_steady_parts.py only)
        self.scan_target = scan_target
        self.scan_memo = graphs.ScanMemo()  # what the full scans found (a later one may read the names only)
        self.t_first: float | None = None
        self.index: int | None = None  # the step begun and not yet ended
        self.t0 = self.c0 = 0.0
        # the thread's run delay at the last step's end, where the next step's count starts (one
        # read a step: each costs ~25 us cold at a boundary, where 1.8 us in a loop)
        self.w_end: float | None = None
        self.w0: float | None = None
        self.anomaly = False
        self.lines = lines.LineSampler() if lines.ENABLED and "lines" not in OFF else None  # per-line time of the steps
        self.line_steps = lines.Schedule()  # which steps the sampler looks at
        self.sampling = False  # the open step is sampled
        self.device = DeviceClock()  # each step's time on the device's clock, when a GPU is in use
        # the audit's own work since the last step's time was taken (its end's record, profiler
        # step, graph scan; this step's profiler start): sent with the next step's record
        self.own_before: float | None = None
        for c in collectors:  # the profiled steps carry no numerics checks (numerics.schedule)
            if hasattr(c, "window"):
                c.window = frozenset(prof.window())
                c.dense = dense_steps(getattr(prof, "steps", 0), c.window)
                c.timed = timed_block(getattr(prof, "steps", 0), c.window)

    def begin(self, i: int, t0: float | None = None, c0: float | None = None) -> None:
        """Step i begins (now, or at the times `t0`/`c0` taken earlier by the caller: a step that
        begins with a DataLoader fetch is timed from the fetch's start)."""
        b0 = time.perf_counter()
        self.index = i
        if TOGGLED:  # (bench_steady_parts.py --toggle only)
            probes.set_part_probes(not off("probes", i))
        self.anomaly = torch.is_anomaly_enabled()
        self.prof.before(i)
        dynamo_skips_our_frames()  # (with or without the numerics collector)
        for c in self.collectors:
            c.step_begin(i)
        self.c0 = time.process_time() if c0 is None else c0
        self.w0 = run_queue.waited_ms() if self.w_end is None else self.w_end
        self.t0 = time.perf_counter() if t0 is None else t0
        if t0 is None and self.own_before is not None:  # (a given t0 holds this work inside the step)
            self.own_before += (self.t0 - b0) * 1e3
        if self.t_first is None:
            self.t_first = self.t0
        self.device.begin(i)
        # (not in the profiler's steps: its start, stop and Python tracer walk the threads' frames,
        # and a look at the step's frames beside them crashed the process)
        checked = any(getattr(c, "step_checked", False) for c in self.collectors)
        self.sampling = self.lines is not None and not self.prof.profiled(i) and self.line_steps.sampled(
            i, checked) and not off("lines", i)
        # (forwards' graphs are watched outside the steps and in the checked and sampled ones: graph_use)
        graph_use.Watch.on = (checked or self.sampling) and not self.prof.profiled(i)
        if self.sampling:
            self.lines.resume()

    def end(self, i: int, failed: bool = False) -> None:
        """Step i ends: its record is sent (its times are taken first, before anything else runs);
        a step that did not fail is followed by its planned graph scan."""
        t1, c1, w1 = time.perf_counter(), time.process_time(), run_queue.waited_ms()
        self.w_end = w1
        if self.sampling:  # (a step the sampler did not look at has nothing to pause or take)
            self.lines.pause()
        graph_use.Watch.on = True
        self.device.end(i)
        self.index = None
        if failed:
            self.prof.stop()
        else:
            self.prof.after(i)
        allocated, reserved = device_memory()
        forecast, near = None, False
        if REHEARSED_MEMORY is not None:  # a CUDA rehearsal with --device-memory: its recorded requests
            allocated, forecast, near = REHEARSED_MEMORY()
        step = wire.Step(index=i, start_s=self.t0 - self.t_first, ms=(t1 - self.t0) * 1e3,
                         cpu_ms=(c1 - self.c0) * 1e3, profiled=self.prof.profiled(i), failed=failed,
                         rss_bytes=rss_bytes(), device_allocated=allocated, device_reserved=reserved,
                         waited_ms=None if w1 is None or self.w0 is None else w1 - self.w0,
                         anomaly_enabled=self.anomaly, lines_sampled=self.sampling,
                         own_before_ms=self.own_before,
                         tallies=self.rec.drain() + (self.lines.take() if self.sampling else []),
                         collected=collected(self.collectors, i), dataloaders=new_loaders(self.rec))
        if not off("records", i):  # (bench_steady_parts.py only)
            self.out.send(step)
        self._send_device_times(self.device.take())
        if forecast is not None:  # the step the rehearsed device would run out in: what holds it is scanned
            self.out.send(wire.Snapshot(path=forecast, when="rehearsal-oom"))
        if not failed and ((i in self.scans and not off("scans", i)) or forecast is not None or near):
            # the planned scans between the first and the last may read the named holders only
            # (graphs.ScanMemo); the last, and one that names what holds a forecast OOM, walk everything
            middle = i in self.scans and i != max(self.scans) and forecast is None and not near
            self.out.send(wire.GraphScan(after_step=i, **graphs.scan(*self.scan_target(), memo=self.scan_memo,
                                                                     named_only=middle)))
        self.own_before = (time.perf_counter() - t1) * 1e3


    def finish(self) -> None:
        """The run's steps are over: the device times still pending are waited for (polled, for a
        bounded time) and sent, with a note on any step left on the host's clock."""
        times, note = self.device.finish()
        self._send_device_times(times, note)

    def _send_device_times(self, times: list[tuple[int, float]], note: str = "") -> None:
        if times or note:
            self.out.send(wire.DeviceTimes(steps=[i for i, _ in times], ms=[ms for _, ms in times], note=note))

    def drop(self, i: int) -> None:
        """Step i, begun, turned out to be none (the program ended before its ending): nothing is
        sent for it, and the probes' tallies stay for what the caller records next."""
        self.index = None
        self.device.open = None
        self.prof.stop()
        if self.lines is not None:
            self.lines.pause()
            self.lines.take()
        collected(self.collectors, i)


def collected(collectors: list, index: int) -> dict:
    """Each collector's data for step `index`, by collector name (those that have some)."""
    out = {}
    for c in collectors:
        data = c.step_end(index)
        if data is not None:
            out[c.name] = data
    return out


# () -> (requested bytes live, forecast snapshot file or None, near the device's memory): set by a
# CUDA rehearsal that records its device's requests (auditor.capture.rehearsal.memory.watch)
REHEARSED_MEMORY: Any = None


def device_memory() -> tuple[int | None, int | None]:
    """The CUDA allocator's (allocated, reserved) bytes, (None, None) without a device in use."""
    if not torch.cuda.is_initialized() or not torch.cuda.is_available():  # (the cheap test first)
        return None, None
    # One read of the allocator's nested stats, the two counters taken from it as torch's
    # memory_allocated/memory_reserved take them: each of those flattens and sorts all ~120 stats
    # in Python first (~90 us a call, twice at every step boundary of a GPU run).
    stats = torch.cuda.memory_stats_as_nested_dict()
    return (stats.get("allocated_bytes", {}).get("all", {}).get("current", 0),
            stats.get("reserved_bytes", {}).get("all", {}).get("current", 0))


def new_loaders(rec: probes.Recorder) -> list[dict]:
    """The DataLoaders made since the last call, each sent once."""
    new = []
    for d in rec.dataloaders:
        if not d["sent"]:
            d["sent"] = True
            w = d["where"]
            new.append({"id": d["id"], "settings": d["settings"], "passed": d.get("passed"),
                        "where": {"file": w[0], "line": w[1], "function": w[2]} if w else None,
                        **({"via": d["via"]} if d.get("via") else {})})
    return new


_statm = "/proc/self/statm"
_statm_fd: tuple[int, int, Any] | None = None  # (pid, fd, its identity): /proc/self is resolved when opened


def rss_bytes() -> int | None:
    """Resident memory of this process, read at every step boundary: a `pread` on /proc/self/statm
    kept open costs ~2 us; opening it at each read costs 15-100 us on a loaded VM. Opened again
    when the program closed it (own_fds)."""
    global _statm_fd
    try:
        if _statm_fd is None or _statm_fd[0] != this_process.PID or not own_fds.still(_statm_fd[1], _statm_fd[2]):
            fd = os.open(_statm, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            _statm_fd = (this_process.PID, fd, own_fds.identity(fd))
        return int(os.pread(_statm_fd[1], 256, 0).split()[1]) * _PAGE
    except (OSError, AttributeError):
        try:
            import resource

            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        except Exception:
            return None


def _page_size() -> int:
    return os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


_PAGE = _page_size()
