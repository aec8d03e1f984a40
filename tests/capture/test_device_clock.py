"""The device's clock of each step (auditor.capture.device_clock): the bookkeeping driven with a clock
the test controls (marks that complete when the test says), and the evidence a real GPU run gave
(tests/fixtures/h200, described in tests/fixtures/README.md: an H200 audit and a plain recording of examples/gpu_bound.py)."""
from __future__ import annotations

import gzip
import json
import shutil
import statistics
from pathlib import Path

import pytest
from conftest import audit

from auditor.capture.device_clock import DeviceClock

ROOT = Path(__file__).resolve().parents[2]
H200 = ROOT / "tests" / "fixtures" / "h200"


class Marks:
    """A device whose marks complete when the test says: each mark is [time_ms, stream, done]."""

    def __init__(self) -> None:
        self.now = 0.0
        self.stream_id = 7
        self.marks: list[list] = []

    def record(self):
        mark = [self.now, self.stream_id, False]
        self.marks.append(mark)
        return mark

    def done(self, mark) -> bool:
        return mark[2]

    def elapsed_ms(self, start, end) -> float:
        assert start[2] and end[2], "elapsed time asked of a mark not yet completed"
        return end[0] - start[0]

    def stream(self, mark):
        return mark[1]

    def complete_all(self) -> None:
        for m in self.marks:
            m[2] = True


def queued(steps: int, ms: float) -> tuple[Marks, DeviceClock]:
    """A device clock over `steps` steps that the host queued at once, each taking `ms` of the
    device's time; no mark has completed yet."""
    marks = Marks()
    clock = DeviceClock(marks)
    for i in range(steps):
        clock.begin(i)
        marks.now += ms
        clock.end(i)
    return marks, clock


def test_device_times_are_read_once_their_marks_complete_and_never_waited_for():
    marks, clock = queued(3, 40.0)
    assert clock.take() == []  # nothing has completed: nothing is read, and nothing waits
    marks.marks[0][2] = marks.marks[1][2] = True
    assert clock.take() == [(0, 40.0)]
    marks.complete_all()
    assert clock.take() == [(1, 40.0), (2, 40.0)]
    assert clock.finish(wait_s=0.0) == ([], "")


def test_a_step_whose_kernel_never_finishes_stays_on_the_hosts_clock_and_the_run_ends():
    marks, clock = queued(4, 10.0)
    for m in marks.marks[:4]:  # steps 0 and 1 complete; step 2's kernel hangs, so step 3 never starts
        m[2] = True
    times, note = clock.finish(wait_s=0.05)
    assert times == [(0, 10.0), (1, 10.0)]
    assert "step(s) 2, 3" in note and "host's clock" in note


def test_a_step_that_switches_streams_is_not_clocked_across_them():
    marks = Marks()
    clock = DeviceClock(marks)
    clock.begin(0)
    marks.stream_id = 8  # the program moved to its own stream during the step
    clock.end(0)
    clock.begin(1)
    clock.end(1)
    marks.complete_all()
    times, note = clock.finish(wait_s=0.0)
    assert times == [(1, 0.0)]
    assert "step(s) 0 ended on another CUDA stream" in note


def test_no_device_no_marks_and_an_error_of_the_device_stops_the_clock_not_the_run():
    clock = DeviceClock(active=lambda: False)
    clock.begin(0)
    clock.end(0)
    assert clock.finish(wait_s=0.0) == ([], "")

    class Broken(Marks):
        def record(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    clock = DeviceClock(Broken())
    clock.begin(0)
    clock.end(0)
    times, note = clock.finish(wait_s=0.0)
    assert times == [] and "could not be read" in note


def test_an_h200_audit_of_a_gpu_bound_program_reports_the_devices_step(tmp_path):
    """examples/gpu_bound.py on an H200 (torch 2.11): the plain program, synchronised at each optimizer
    step, ran 64.48 ms/step; the host queued each audited step in ~2.6 ms. Its reports, rendered
    again from its evidence, state the device's step, recomputed here from the events' series."""
    run = tmp_path / "run"
    shutil.copytree(H200 / "audited_gpu_bound", run)
    a = audit("report", str(run), out=run)
    assert a.returncode == 0, a.stderr
    ev = json.loads((run / "evidence.json").read_text())
    doc = json.loads((run / "findings.json").read_text())
    timed = [s for s in ev["steps"] if not s["profiled"] and s.get("numerics") is None]
    assert len(timed) >= 15  # a 30-step audit times at least 15 steps
    device = statistics.median(s["device_ms"] for s in timed)
    host = statistics.median(s["ms"] for s in timed)
    assert device > 20 * host  # the host only queued the step
    assert abs(device - 64.48) / 64.48 < 0.05  # the plain program's synchronised step
    steps = doc["steps"]
    assert steps["median_ms"] == round(device, 3)
    assert steps["clock"]["bound"] == "device" and steps["clock"]["source"] == "events"
    assert steps["clock"]["host_ms"] == round(host, 3)
    assert steps["device_ms"] == [s["device_ms"] for s in ev["steps"]]
    summary = (run / "summary.txt").read_text()
    assert f"median {device:.2f} ms/step" in summary
    assert f"step clock: device-bound: the device ran each step in {device:.2f} ms" in summary
    # the checks' and the profiler's cost are measured on the device's clock too: host work the
    # device waits behind costs a device-bound step nothing (+62% on the host's clock)
    cost = steps["own_cost"]
    checked = statistics.median(max(s["ms"], s["device_ms"]) for s in ev["steps"] if s.get("numerics"))
    assert cost["checked_ms"] == round(checked, 3) and abs(cost["checked_ms"] / cost["timed_ms"] - 1) < 0.05


def _per_step_device_ms(path: Path) -> tuple[list[float], list[float]]:
    """Each ProfilerStep's host span and its device work, from the raw trace: the kernels, copies and
    memsets whose launch (same correlation id) lies inside the step, merged across streams."""
    events = json.loads(gzip.open(path, "rt").read())["traceEvents"]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("ProfilerStep#"))
    launch_step = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            for k, (lo, hi) in enumerate(steps):
                if lo <= e["ts"] < hi:
                    launch_step[e["args"]["correlation"]] = k
    work: list[list[tuple[float, float]]] = [[] for _ in steps]
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            k = launch_step.get(e.get("args", {}).get("correlation"))
            if k is not None:
                work[k].append((e["ts"], e["ts"] + e["dur"]))
    busy = []
    for spans in work:
        total, end = 0.0, float("-inf")
        for lo, hi in sorted(spans):
            if hi > end:
                total += hi - max(lo, end)
                end = hi
        busy.append(total / 1000.0)
    return [(hi - lo) / 1000.0 for lo, hi in steps], busy


def test_a_plain_recording_of_a_gpu_bound_program_is_on_the_devices_clock(tmp_path):
    """The plain H200 recording of examples/gpu_bound.py (steps 6-8, no auditor): each ProfilerStep's
    host span is ~4 ms, its kernels ~69 ms; the median step and its bound are the device's."""
    trace = H200 / "plain_gpu_bound.json.gz"
    host, device = _per_step_device_ms(trace)
    a = audit("analyze", str(trace), out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    steps = a.findings_doc["steps"]
    assert steps["host_ms"] == [round(v, 3) for v in host]
    assert steps["device_ms"] == pytest.approx(device, abs=2e-3)
    assert steps["median_ms"] == pytest.approx(statistics.median(max(h, d) for h, d in zip(host, device)), abs=2e-3)
    assert steps["clock"]["bound"] == "device" and min(device) > 10 * max(host)
    assert "step clock: device-bound" in (a.out / "summary.txt").read_text()  # (--verbose's line)


def test_a_host_bound_recording_keeps_the_hosts_step():
    """The plain H100 recording of examples/gpu_clean.py: the device works ~0.2 ms of a ~3 ms step."""
    from conftest import FIXTURES

    from auditor.evidence.step_clock import of_trace
    from auditor.evidence.trace.load import load_trace

    path = FIXTURES / "h100" / "plain" / "plain_gpu_clean.json.gz"
    host, device = _per_step_device_ms(path)
    clock = of_trace(load_trace(path))
    assert clock.bound == "host"
    assert clock.step_ms == pytest.approx(statistics.median(host), abs=1e-6)
    assert clock.device_ms == pytest.approx(statistics.median(device), abs=2e-3)


def test_no_mark_is_recorded_into_a_cuda_graph_capture():
    from auditor.capture.device_clock import Capturing

    class InCapture(Marks):
        capturing = False

        def record(self):
            if self.capturing:
                raise Capturing("the step's stream was capturing a CUDA graph")
            return super().record()

    marks = InCapture()
    clock = DeviceClock(marks)
    clock.begin(0)
    marks.capturing = True  # the program captures its step into a graph
    clock.end(0)
    clock.begin(1)
    marks.capturing = False
    clock.end(1)
    marks.complete_all()
    times, note = clock.finish(wait_s=0.0)
    assert times == [] and "step(s) 0, 1 began or ended while the program captured a CUDA graph" in note


def test_a_run_whose_device_clock_failed_reports_the_hosts_step_and_says_why(tmp_path):
    """The H200 audit of examples/gpu_bound.py as it would read had its kernels hung from step 2 on:
    the clock's own note (the hung steps), added to the evidence as the runner adds it, and no step
    with a device time. The report finishes on the host's clock and its summary says why."""
    from auditor.evidence.step_clock import DEVICE_CLOCK_NOTE

    marks, clock = queued(30, 64.0)
    times, note = clock.finish(wait_s=0.0)  # no mark ever completes
    assert times == [] and note
    run = tmp_path / "run"
    shutil.copytree(H200 / "audited_gpu_bound", run)
    ev = json.loads((run / "evidence.json").read_text())
    for s in ev["steps"]:
        s["device_ms"] = None
    ev["environment"]["notes"] = [*ev["environment"].get("notes", []), f"{DEVICE_CLOCK_NOTE} {note}"]
    (run / "evidence.json").write_text(json.dumps(ev))
    a = audit("report", str(run), out=run)
    assert a.returncode == 0, a.stderr
    timed = [s for s in ev["steps"] if not s["profiled"] and s.get("numerics") is None]
    host = statistics.median(s["ms"] for s in timed)
    steps = json.loads((run / "findings.json").read_text())["steps"]
    assert steps["median_ms"] == round(host, 3) and steps["device_ms"] == [None] * len(ev["steps"])
    summary = (run / "summary.txt").read_text()
    assert f"median {host:.2f} ms/step" in summary
    assert f"step clock: the host's ({DEVICE_CLOCK_NOTE} {note})" in summary
