"""Overhead of `audit run` on a ~10 ms training step (examples/clean.py, its batch chosen so that
the plain step takes `--step-ms` on this machine now, as in bench_step_overhead.py).

Measures, on this machine:
  1. steady-state: median interval between step starts under audit (outside the profiled window
     and the graph-scan boundaries) vs the same step called in a plain loop; target within 10%;
  2. end to end: wall time of `audit run --steps 50` vs the 50 plain steps themselves; target
     within 5 s more; also vs a plain process that imports torch and the trainer and runs 50 steps.
Each side runs REPEATS times, interleaved; each audit is compared with the plain run just before
it (the machine's speed drifts) and the median of those paired ratios is reported. On a VM whose
speed drifts by more than the effect, use bench_step_overhead.py (one process, twin copies) for (1).

    python bench/bench_overhead.py [--steps 50] [--repeats 5] [--step-ms 10 | --batch 256]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def sized_trainer(batch: int) -> str:
    """examples/clean.py with another batch (the trainer both sides run; _common is found on
    PYTHONPATH), made from its text so that the two cannot drift apart."""
    text = (ROOT / "examples" / "clean.py").read_text()
    assert text.count("make()") == 1, "examples/clean.py no longer calls make() once"
    return text.replace("make()", f"make(batch={batch})")


PLAIN = r'''
import json, sys, time
sys.path.insert(0, {examples!r})
sys.path.insert(0, {trainer_dir!r})
import clean_sized as clean
starts = []
for i in range({steps}):
    starts.append(time.perf_counter())
    clean.step(i)
end = time.perf_counter()
print(json.dumps({{"starts": starts, "end": end, "steps_s": end - starts[0]}}))
'''


def plain_run(steps: int, trainer: Path) -> dict:
    t0 = time.perf_counter()
    code = PLAIN.format(examples=str(ROOT / "examples"), trainer_dir=str(trainer.parent), steps=steps)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    d = json.loads(out.stdout)
    d["process_s"] = time.perf_counter() - t0
    d["intervals_ms"] = [(b - a) * 1e3 for a, b in zip(d["starts"], d["starts"][1:])]
    return d


def audited_run(steps: int, trainer: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "examples"),
                                                                          os.environ.get("PYTHONPATH")]))}
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "auditor", "run", f"{trainer}:step", "--steps", str(steps),
                        "--quiet", "--out", tmp], check=True, cwd=ROOT, capture_output=True, env=env)
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
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--step-ms", type=float, default=10.0,
                    help="choose the batch so that the plain step takes about this long here")
    ap.add_argument("--batch", type=int, default=None, help="rows a batch instead of --step-ms (clean.py: 256)")
    a = ap.parse_args()
    if a.batch is None:
        sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "bench")]
        from bench_step_overhead import calibrated_batch

        a.batch = calibrated_batch(a.step_ms)
    plain, audited = [], []
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Path(tmp) / "clean_sized.py"
        trainer.write_text(sized_trainer(a.batch))
        # This machine's speed drifts by 20-40% over tens of seconds (a shared VM host), so each audit
        # is paired with the plain run right before it and the ratios of the pairs are what count.
        for _ in range(a.repeats):
            plain.append(plain_run(a.steps, trainer))
            audited.append(audited_run(a.steps, trainer))
    p_ints = [statistics.median(p["intervals_ms"][2:]) for p in plain]
    a_ints = [statistics.median(r["intervals_ms"]) for r in audited]
    ratios = sorted(x / y for x, y in zip(a_ints, p_ints))
    over_steps = sorted(r["wall_s"] - p["steps_s"] for p, r in zip(plain, audited))
    over_proc = sorted(r["wall_s"] - p["process_s"] for p, r in zip(plain, audited))
    med = statistics.median
    print(f"examples/clean.py's step at batch {a.batch}")
    print(f"step interval, plain loop     : {med(p_ints):8.2f} ms (median of {a.repeats} runs)")
    print(f"step interval, under audit    : {med(a_ints):8.2f} ms")
    print("  paired overhead per run     : " + " ".join(f"{100 * (r - 1):+.1f}%" for r in ratios))
    print(f"  median paired overhead      : {100 * (med(ratios) - 1):+.1f}% (target < 10%)")
    print(f"{a.steps} plain steps             : {med(p['steps_s'] for p in plain):8.2f} s")
    print(f"plain process (import+steps)  : {med(p['process_s'] for p in plain):8.2f} s")
    print(f"audit run --steps {a.steps}         : {med(r['wall_s'] for r in audited):8.2f} s")
    print(f"  over the plain steps, paired: {med(over_steps):+.2f} s (target < 5 s; runs "
          + " ".join(f"{x:+.2f}" for x in over_steps) + ")")
    print(f"  over the plain process      : {med(over_proc):+.2f} s")


if __name__ == "__main__":
    main()
