"""Per-step overhead of auditing a whole program (`audit run script.py`), against a plain run.

examples/clean.py's trainer written as a plain script (its own loop over `steps` iterations) times
each iteration itself: the interval between one iteration's start and the next's, which holds
everything the audit adds at a step boundary (the step record, the collectors). It runs in turns
`python script.py` and `audit run script.py --to-end --no-profile`, `--rounds` times each, and
compares the medians of those intervals, over all runs and round by round (a plain run and the
audited run right after it) (the first `--warm` iterations of each run left out).
Separate processes, so this machine's drift between runs shows: read it beside
bench_step_overhead.py's one-process figure for the step-function mode.

    python bench/bench_program_overhead.py [--steps 200] [--rounds 3] [--no-numerics]
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

SCRIPT = """\
import json, sys, time
sys.path.insert(0, {examples!r})
from _common import Batches, make

loader, model, opt, loss_fn = make()
batches = Batches(loader)
times = []
for i in range({steps}):
    times.append(time.perf_counter())
    x, y = batches.next()
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
times.append(time.perf_counter())
with open({out!r}, "w") as f:
    json.dump([(b - a) * 1e3 for a, b in zip(times, times[1:])], f)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm", type=int, default=20)
    ap.add_argument("--no-numerics", action="store_true")
    args = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    plain, audited, ratios = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        script = Path(tmp) / "train.py"
        script.write_text(SCRIPT.format(examples=str(ROOT / "examples"), steps=args.steps, out=str(out)))
        for _ in range(args.rounds):
            subprocess.run([sys.executable, str(script)], check=True, env=env, cwd=tmp)
            p_round = json.loads(out.read_text())[args.warm:]
            plain.extend(p_round)
            subprocess.run([sys.executable, "-m", "auditor", "run", str(script), "--steps", str(args.steps),
                            "--to-end", "--no-profile", "-q", "--out", str(Path(tmp) / "audit"),
                            *(("--no-numerics",) if args.no_numerics else ())],
                           check=True, env=env, cwd=tmp, stdout=subprocess.DEVNULL)
            a_round = json.loads(out.read_text())[args.warm:]
            audited.extend(a_round)
            ratios.append(statistics.median(a_round) / statistics.median(p_round) - 1)
    p, a = statistics.median(plain), statistics.median(audited)
    print(f"{len(plain)} plain and {len(audited)} audited iterations of examples/clean.py's step as a script"
          f"{' (--no-numerics)' if args.no_numerics else ''}, threads {env['OMP_NUM_THREADS']}")
    print(f"plain iteration    median {p:.2f} ms")
    print(f"audited iteration  median {a:.2f} ms")
    print(f"overhead           median {100 * (a / p - 1):+.1f}% per step, {a - p:+.2f} ms; paired rounds "
          + ", ".join(f"{100 * r:+.1f}%" for r in ratios) + f" (median {100 * statistics.median(ratios):+.1f}%)")


if __name__ == "__main__":
    main()
