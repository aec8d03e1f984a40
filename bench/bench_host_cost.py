"""The audit's host cost per torch call in the steps whose times it reports, on a host-bound step.

    python bench/bench_host_cost.py [--tree DIR] [--ops N] [--steps S] [--rounds R] [--steady FIRST]

A GPU step that is host-bound pays exactly the host's time per call: this bench stands one in on
the CPU, a step of N tiny calls (N/2 multiply-adds on an 8-element tensor, 4 tensor calls each
... see STEP) with a small backward and an SGD update. It times, in separate processes:

* plain: the step called in a loop by `python` alone (median of the steps after the first 5);
* audited: `audit run STEP.py:step --steps S` (defaults: numerics and profiler on) with the
  auditor of `--tree` (default: this checkout; give an older worktree to compare), the median of
  the steps the audit reports as its own (evidence.json: the timed steps where the run has them,
  else the unprofiled steps, all of which then carry the checks).

With `--steady FIRST` the audited figure is instead the mean of every unprofiled step from step
FIRST on, whatever its role (timed or checked): the steady state as the program's own clock sees it
(the H100 table's steps 40-140), where the checks' one step in 16 is paid too.

Per-call cost = (audited - plain) / calls per step, in process CPU time (robust on a
loaded machine) and in wall time. Rounds alternate plain and audited; the medians over rounds are
printed.
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

STEP = '''import torch

torch.manual_seed(0)
w = torch.randn(8, requires_grad=True)
opt = torch.optim.SGD([w], lr=1e-3)
N = {n}


def step():
    t = w
    for _ in range(N // 4):
        t = torch.tanh(t * 0.999 + 0.001)  # (mul, add, tanh: the calls of a small model's step)
    loss = t.sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


if __name__ == "__main__":
    import json, sys, time
    times = []
    for i in range({steps}):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(((time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3))
    json.dump(times[5:], sys.stdout)
'''


def plain(path: Path, steady: int | None = None) -> tuple[float, float]:
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout
    times = json.loads(out)  # (from step 5 on)
    if steady is not None:
        times = times[max(steady - 5, 0):]
        return statistics.mean(t[0] for t in times), statistics.mean(t[1] for t in times)
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def audited(path: Path, tree: Path, steps: int, out: Path, steady: int | None = None) -> tuple[float, float, int]:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    # (run from the step's folder: `-m` puts the working directory first on sys.path)
    subprocess.run([sys.executable, "-m", "auditor", "run", f"{path}:step", "--steps", str(steps), "--quiet",
                    "--out", str(out)], env=env, check=True, capture_output=True, cwd=path.parent)
    ev = json.loads((out / "evidence.json").read_text())
    steps_ = [s for s in ev["steps"] if not s["failed"] and not s["profiled"]]
    timed = [s for s in steps_ if s.get("numerics") is None] if any(s.get("numerics") for s in steps_) else steps_
    if steady is not None:
        use = [s for s in steps_ if s["index"] >= steady]
        return statistics.mean(s["ms"] for s in use), statistics.mean(s["cpu_ms"] for s in use), len(use)
    use = timed or steps_
    return statistics.median(s["ms"] for s in use), statistics.median(s["cpu_ms"] for s in use), len(use)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steady", type=int, default=None, metavar="FIRST",
                    help="the mean of every unprofiled step from FIRST on (checked ones too), not the timed median")
    a = ap.parse_args()
    calls = 3 * (a.ops // 4) + 1  # the loop's torch calls and the loss's sum
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "hostbound.py"
        path.write_text(STEP.format(n=a.ops, steps=a.steps))
        rows = []
        for r in range(a.rounds):
            p = plain(path, a.steady)
            q = audited(path, a.tree, a.steps, Path(tmp) / f"out{r}", a.steady)
            rows.append((p, q))
            print(f"round {r}: plain {p[0]:.2f} ms ({p[1]:.2f} CPU), audited {q[0]:.2f} ms ({q[1]:.2f} CPU) "
                  f"over {q[2]} {'steady' if a.steady is not None else 'reported'} steps", flush=True)
    pw, pc = (statistics.median(r[0][k] for r in rows) for k in (0, 1))
    aw, ac = (statistics.median(r[1][k] for r in rows) for k in (0, 1))
    print(f"tree {a.tree}: {calls} torch calls/step; plain {pw:.2f} ms/step ({pc:.2f} CPU), reported steps "
          f"{aw:.2f} ms ({ac:.2f} CPU): {aw / pw:.2f}x wall, {ac / pc:.2f}x CPU; "
          f"{(ac - pc) / calls * 1e3:.2f} us CPU per call ({(aw - pw) / calls * 1e3:.2f} us wall)")


if __name__ == "__main__":
    main()
