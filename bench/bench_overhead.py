"""Overhead of `audit run` on a ~10 ms training step (examples/clean.py).

Measures, on this machine:
  1. steady-state: median interval between step starts under audit (outside the profiled window
     and the graph-scan boundaries) vs the same step called in a plain loop; target within 10%;
  2. end to end: wall time of `audit run --steps 50` vs the 50 plain steps themselves; target
     within 5 s more; also vs a plain process that imports torch and the trainer and runs 50 steps.
Each side runs REPEATS times, interleaved, and the medians are reported.

    python bench/bench_overhead.py [--steps 50] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAIN = r'''
import json, sys, time
sys.path.insert(0, {examples!r})
import clean
starts = []
t_all = time.perf_counter()
for i in range({steps}):
    starts.append(time.perf_counter())
    clean.step(i)
end = time.perf_counter()
print(json.dumps({{"starts": starts, "end": end, "steps_s": end - starts[0]}}))
'''


def plain_run(steps: int) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", PLAIN.format(examples=str(ROOT / "examples"), steps=steps)],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    d = json.loads(out.stdout)
    d["process_s"] = time.perf_counter() - t0
    d["intervals_ms"] = [(b - a) * 1e3 for a, b in zip(d["starts"], d["starts"][1:])]
    return d


def audited_run(steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "auditor", "run", "examples/clean.py:step", "--steps", str(steps),
                        "--quiet", "--out", tmp], check=True, cwd=ROOT, capture_output=True)
        wall = time.perf_counter() - t0
        ev = json.loads((Path(tmp) / "evidence.json").read_text())
    steps_ = ev["steps"]
    window = set(ev["profile"]["steps"]) if ev.get("profile") else set()
    scans = {s["after_step"] for s in ev["graph_scans"]}
    # an interval is "steady state" when neither its step nor the boundary after it does extra work
    intervals = [(b["start_s"] - a["start_s"]) * 1e3 for a, b in zip(steps_, steps_[1:])
                 if a["index"] not in window and b["index"] not in window and a["index"] not in scans
                 and a["index"] >= 2]
    return {"wall_s": wall, "intervals_ms": intervals, "steps_s": sum(s["ms"] for s in steps_) / 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    plain, audited = [], []
    for _ in range(a.repeats):
        plain.append(plain_run(a.steps))
        audited.append(audited_run(a.steps))
    p_int = statistics.median(statistics.median(p["intervals_ms"][2:]) for p in plain)
    a_int = statistics.median(statistics.median(r["intervals_ms"]) for r in audited)
    p_steps = statistics.median(p["steps_s"] for p in plain)
    p_proc = statistics.median(p["process_s"] for p in plain)
    a_wall = statistics.median(r["wall_s"] for r in audited)
    print(f"step interval, plain loop     : {p_int:8.2f} ms (median of {a.repeats} runs)")
    print(f"step interval, under audit    : {a_int:8.2f} ms  -> overhead {100 * (a_int / p_int - 1):+.1f}% (target < 10%)")
    print(f"{a.steps} plain steps             : {p_steps:8.2f} s")
    print(f"plain process (import+steps)  : {p_proc:8.2f} s")
    print(f"audit run --steps {a.steps}         : {a_wall:8.2f} s  -> {a_wall - p_steps:+.2f} s over the plain steps "
          f"(target < 5 s), {a_wall - p_proc:+.2f} s over the plain process")


if __name__ == "__main__":
    main()
