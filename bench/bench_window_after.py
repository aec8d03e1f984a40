"""Whether torch's own profiler leaves a per-step cost behind it, with no auditor in the process.

    python bench/bench_window_after.py [--device cuda] [--program proxy] [--steps 1200] [--at 600]
                                       [--width 300] [--rounds 3] [--cpus 2,3] [--teardown 1]

A plain script (bench/steady_programs.py's program, each iteration timed by its own clock, on cuda
synchronised) runs twice a round, alternated: once as it is, once with a profiler window at step
AT made as `audit run` makes its own (auditor/capture/child.py): a calibration recording of step
AT, stopped and exported, then a window of steps AT+1..AT+3 (`record_shapes`, `with_stack`,
`profile_memory`, CPU and CUDA activities, the allocator's history on over the window on cuda), its
trace exported at its end, with `TEARDOWN_CUPTI` set as the audit sets it (`--teardown`, default 1;
0: Kineto's default, CUPTI left subscribed).

Each run's figure is the median iteration over the WIDTH iterations after the window (from AT+6)
over the median of the WIDTH before it (up to AT-1); the run without a window gives the same
ratio over the same iterations, the control. Their quotient, median over rounds, is what the
profiler leaves behind it on each later step of any program that used it: on a CPU nothing; on a
GPU, CUPTI's callbacks on every kernel launch if it stays subscribed. A cost here is torch's, not
the audit's, and the audit's own measure of the same (`bench_steady_parts.py --window-at N`) is to
be read against it.
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

from steady_programs import SETUP, describe, setup

PROGRAM = """\
import json, os, sys, time, warnings
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, schedule

torch.manual_seed(0)
warnings.filterwarnings("ignore", message="Profiler won't be using warmup")  # (the audit's window has none)
{setup}
{sync}
AT, OUT = int(sys.argv[2]), sys.argv[3]
CUDA = torch.cuda.is_available() and DEVICE == "cuda"
acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])


def recording(**kw):
    return profile(activities=acts, record_shapes=True, with_stack=True, profile_memory=True, **kw)


prof = None
times = []
for i in range({steps}):
    sync()
    times.append((time.perf_counter(), time.process_time()))
    if i == AT:  # the audit's calibration: one step recorded, stopped, exported
        if CUDA:
            torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                                     max_entries=100_000)
        prof = recording()
        prof.start()
    elif i == AT + 1:
        prof.stop()
        prof.export_chrome_trace(os.path.join(OUT, "calibration.json"))
        prof = recording(schedule=schedule(wait=0, warmup=0, active=3, repeat=1),
                         on_trace_ready=lambda p: p.export_chrome_trace(os.path.join(OUT, "window.json")))
        prof.start()
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if prof is not None and AT + 1 <= i <= AT + 3:
        prof.step()
        if i == AT + 3:
            prof.stop()
            prof = None
            if CUDA:
                torch.cuda.memory._record_memory_history(enabled=None)
sync()
times.append((time.perf_counter(), time.process_time()))
with open(sys.argv[1], "w") as f:
    json.dump([[(b[k] - a[k]) * 1e3 for k in (0, 1)] for a, b in zip(times, times[1:])], f)
"""


def around(path: Path, at: int, width: int) -> tuple[float, float]:
    """(median wall ms of the `width` iterations before step `at`, of the `width` from at+6 on)."""
    wall = [t[0] for t in json.loads(path.read_text())]
    return statistics.median(wall[max(0, at - width):at]), statistics.median(wall[at + 6:at + 6 + width])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--program", choices=sorted(SETUP), default="proxy")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--at", type=int, default=600, help="the step the window's calibration records")
    ap.add_argument("--width", type=int, default=300, help="iterations compared on each side of the window")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpus", default=None, help="pin every run to these CPUs, e.g. 2,3")
    ap.add_argument("--teardown", choices=("0", "1"), default="1",
                    help="TEARDOWN_CUPTI for the runs (1: as `audit run` sets it)")
    args = ap.parse_args()
    if args.at + 6 + args.width > args.steps:
        sys.exit(f"--steps {args.steps} leaves no {args.width} iterations after a window at {args.at}")
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TEARDOWN_CUPTI=args.teardown,
               KINETO_LOG_LEVEL="3", TORCH_CPP_LOG_LEVEL="ERROR")  # (as the audit quiets Kineto)
    quotients: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        prog = Path(tmp) / "program.py"
        sync = "sync = torch.cuda.synchronize" if args.device == "cuda" else "def sync():\n    pass"
        prog.write_text(PROGRAM.format(setup=setup(args.program, None, None, args.device), sync=sync,
                                       steps=args.steps))
        times = Path(tmp) / "times.json"
        for r in range(args.rounds):
            ratios = {}
            for name, at in (("no window", -10), ("window", args.at)):
                run = subprocess.run([sys.executable, str(prog), str(times), str(at), tmp], env=env, cwd=tmp,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                if run.returncode != 0:  # (Kineto's stage lines go to stderr: shown only for a failure)
                    sys.exit(f"the {name} run failed: {run.stderr[-2000:]}")
                before, after = around(times, args.at, args.width)
                ratios[name] = after / before
                print(f"round {r} {name:9s}: median iteration before step {args.at} {before:.3f} ms, "
                      f"after {after:.3f} ms: {after / before:.3f}x", flush=True)
            quotients.append(ratios["window"] / ratios["no window"])
            print(f"    the window's after/before over the control's: {quotients[-1]:.3f}x", flush=True)
    print(f"\n{describe(args.program, None, None)}, {args.device}, TEARDOWN_CUPTI={args.teardown}; window at "
          f"{args.at}, {args.width} iterations each side, {args.rounds} round(s): what torch's profiler leaves "
          f"behind it, median {statistics.median(quotients):.3f}x (per round {', '.join(f'{q:.3f}' for q in quotients)})")


if __name__ == "__main__":
    main()
