"""A step's wait for data leaves out the time another process held the CPU (the thread's run-queue
delay, auditor.capture.run_queue): the machine's load is no wait that DataLoader workers remove."""
from __future__ import annotations

import statistics

import pytest

from auditor.capture import run_queue
from conftest import ROOT, audit

PROG = ROOT / "tests" / "data" / "loader_beside_a_hog.py"


@pytest.mark.skipif(run_queue.waited_ms() is None, reason="this kernel keeps no run-queue delay (/proc/thread-self/schedstat)")
def test_a_fetch_beside_a_busy_process_waits_its_own_time_not_the_other_process_turn(tmp_path):
    a = audit("run", f"{PROG}:step", "--steps", "12", "--no-profile", "--no-numerics", "--quiet", out=tmp_path / "o")
    assert a.returncode == 0, a.stderr[-3000:]
    steps = [s for s in a.evidence["steps"][1:-1] if not s["failed"]]  # (the last one gives the CPU back)
    wall = statistics.median(s["ms"] for s in steps)
    cpu = statistics.median(s["cpu_ms"] for s in steps)
    wait = statistics.median(sum(t["ms"] for t in s["tallies"] if t["kind"] == "data-wait") for s in steps)
    # the busy process took its turns on the one CPU: a step took about twice its CPU time (at least
    # 1.3x: the busy process is itself descheduled at times on a loaded machine)
    assert wall >= 1.3 * cpu, (wall, cpu)
    # the fetch's 8 items at 0.5 ms of CPU each, not the ~8 ms the wall clock saw (the step's CPU
    # time holds the fetch's and the update's)
    assert 3.5 <= wait <= cpu, (wait, cpu, wall)
