"""Overhead of CUDA rehearsal: the per-step time of a GPU trainer rehearsed on the CPU vs the same
trainer's CPU version (every "cuda" replaced by "cpu") run plainly.

Three sides, each in its own process, interleaved REPEATS times, OMP_NUM_THREADS=1 for steadier
numbers on a shared machine:
  plain      the CPU version, plain loop, no auditor;
  probes     the CPU version with the probes installed (what `audit run` adds anyway);
  rehearsal  the CUDA version with rehearsal + probes installed, as `audit run` sets them up.
Rehearsal's own cost is `rehearsal - probes`; `rehearsal - plain` is what a user of a rehearsed
audit pays per step before the collectors and the profiler. Per-step process CPU time (with one
thread, what the step itself costs, whatever else loads the machine) and wall time; medians after
WARMUP steps, then the median over repeats.

    python bench/bench_rehearsal.py [--steps 40] [--repeats 3] [--examples gpu_amp,gpu_clean]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
DEFAULT = ("gpu_clean", "gpu_amp", "gpu_cuda_everywhere", "gpu_dataset_cuda", "gpu_small_launches")
WARMUP = 5
RUN = r'''
import importlib.util, json, sys, time
side, path = sys.argv[1], sys.argv[2]
if side in ("probes", "rehearsal"):
    from auditor.capture import probes, rehearsal
    if side == "rehearsal":
        assert rehearsal.install("on", path)
    probes.install()
spec = importlib.util.spec_from_file_location("trainer", path)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
cpu, wall = [], []
for i in range({steps}):
    c0, t0 = time.process_time(), time.perf_counter()
    mod.step(i)
    cpu.append((time.process_time() - c0) * 1e3)
    wall.append((time.perf_counter() - t0) * 1e3)
print(json.dumps({{"cpu": cpu, "wall": wall}}))
'''


def run_side(side: str, path: Path, steps: int) -> dict[str, float]:
    """Median per-step CPU and wall ms of one process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", RUN.format(steps=steps), side, str(path)], capture_output=True,
                         text=True, check=True, cwd=path.parent, env=env)
    times = json.loads(out.stdout.strip().splitlines()[-1])
    return {k: statistics.median(v[WARMUP:]) for k, v in times.items()}


def bench(name: str, steps: int, repeats: int, tmp: Path) -> dict:
    cuda_path = EXAMPLES / f"{name}.py"
    cpu_path = tmp / f"{name}_cpu.py"
    cpu_path.write_text(cuda_path.read_text().replace("cuda", "cpu"))
    sides = {"plain": (cpu_path, []), "probes": (cpu_path, []), "rehearsal": (cuda_path, [])}
    for _ in range(repeats):
        for side, (path, got) in sides.items():
            got.append(run_side(side, path, steps))
    row: dict = {"example": name}
    for clock in ("cpu", "wall"):
        med = {side: statistics.median(r[clock] for r in got) for side, (_, got) in sides.items()}
        row[clock] = {**{f"{k}_ms": round(v, 3) for k, v in med.items()},
                      "rehearsal_extra_ms": round(med["rehearsal"] - med["probes"], 3),
                      "rehearsal_over_probes": round(med["rehearsal"] / med["probes"] - 1, 3),
                      "rehearsal_over_plain": round(med["rehearsal"] / med["plain"] - 1, 3)}
    row["runs"] = {side: got for side, (_, got) in sides.items()}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--examples", default=",".join(DEFAULT))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.examples.split(","):
            rows.append(bench(name, args.steps, args.repeats, Path(tmp)))
    for clock in ("cpu", "wall"):
        print(f"per-step {clock} time (median ms)")
        print(f"  {'example':22} {'plain':>8} {'probes':>8} {'rehearsal':>10} {'extra':>7} {'vs probes':>10} "
              f"{'vs plain':>9}")
        for r in rows:
            c = r[clock]
            print(f"  {r['example']:22} {c['plain_ms']:8.2f} {c['probes_ms']:8.2f} {c['rehearsal_ms']:10.2f} "
                  f"{c['rehearsal_extra_ms']:+7.2f} {c['rehearsal_over_probes']:+10.1%} {c['rehearsal_over_plain']:+9.1%}")
    print(json.dumps({"steps": args.steps, "repeats": args.repeats, "warmup": WARMUP, "rows": rows}))


if __name__ == "__main__":
    main()
