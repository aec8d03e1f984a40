"""The audit's steady-state cost counted in instructions: what the program's clock would see on a
machine that ran every instruction at one speed.

    python bench/bench_instructions.py [--steps 2000] [--first 1600] [--last 2000] [--program proxy]
                                       [--parts all,none,probes,...] [--width 32] [--layers 40]

bench_steady_parts.py times the issue's CPU proxy (40 tiny Linear+LayerNorm+GELU layers, a batch
of 16, AdamW, one thread) by the program's own clock, plain and audited in alternation; on a shared
VM one plain run differs from the next by up to 38%, more than the audit costs. This bench runs the
same program under valgrind's callgrind, which counts the instructions each process executes, every
thread of it: the count repeats from one run to the next within ~0.05% (Python's randomised hashing
and the temporary paths differ), whatever else the machine runs. The program turns the count on at
iteration FIRST and dumps it at LAST (callgrind's client requests, through a 3-line C helper
compiled here with the system's valgrind headers), so
the start-up, the dense checks of the first steps and the profiler window stay out of it, and the
audited run's counts are the child's own (`audit run` under `valgrind --trace-children=yes`: the
parent counts nothing).

`--program cell-loop` counts another host-bound shape: a GRUCell called 32 times a step at the
top level (an RNN trainer's loop: 33 outermost module calls a step), a head, AdamW.

Each variant is one audited run, as bench_steady_parts runs them: `all` (the default audit),
`none` (every part of AUDITOR_BENCH_OFF left out: what is left is the step finder and the
phase probes), a part's name (the audit without it). Printed: instructions per iteration over
FIRST..LAST-1, plain and each variant, the ratio to plain, and each part's share of what the
full audit adds. What instructions leave out: the kernel's time in the audit's system calls
(a few a step: the resident-memory read, the record's write, the CPU clock), cache misses and
the machine's drift; bench_steady_parts measures those, noisily.

Valgrind runs a program ~50x slower while it counts, and several times slower before FIRST: the
default long run takes ~12 minutes a run on a 2-core VM (plain, then each variant). valgrind's CPU
model has no AVX-512: torch runs its AVX2 kernels, in both.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from auditor.capture.bench_switches import PARTS  # noqa: E402
from bench_steady_parts import bench_env, label, variant  # noqa: E402
from steady_programs import SETUP, describe, setup  # noqa: E402

HELPER = """\
#include <valgrind/callgrind.h>
void count_on(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void count_off(void) { CALLGRIND_DUMP_STATS_AT("window"); CALLGRIND_STOP_INSTRUMENTATION; }
"""

PROGRAM = """\
import ctypes, sys
import torch
from torch import nn

torch.manual_seed(0)
{setup}
count = ctypes.CDLL(sys.argv[1])
for i in range({steps}):
    if i == {first}:
        count.count_on()
    if i == {last}:
        count.count_off()
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
if {last} >= {steps}:
    count.count_off()
"""


def window_events(out_dir: Path) -> dict[str, int]:
    """The events counted in the window (Ir, the instructions; with the cache model also its misses:
    I1mr D1mr D1mw, first level, and ILmr DLmr DLmw, last level), from the one dump that counted
    any (the audited run's parent and the tools it runs count none; the final dump at exit, after
    count_off, counts none either)."""
    found = []
    for f in out_dir.iterdir():
        text = f.read_text(errors="replace")
        events = re.search(r"^events: (.+)$", text, re.M)
        summary = re.search(r"^summary: ([\d ]+)$", text, re.M)
        if events and summary and re.search(r"^desc: Trigger: Client Request: window$", text, re.M):
            found.append(dict(zip(events.group(1).split(), map(int, summary.group(1).split()))))
    if len(found) != 1:
        sys.exit(f"expected one window dump in {out_dir}, found {len(found)}")
    return found[0]


def run(cmd: list[str], out_dir: Path, env: dict, cwd: Path, cache: list[str],
        keep: Path | None = None) -> dict[str, int]:
    out_dir.mkdir()
    vg = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--trace-children=yes", *cache,
          f"--callgrind-out-file={out_dir}/callgrind.%p"]
    p = subprocess.run(vg + cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed under valgrind: {p.stderr[-2000:]}")
    if keep is not None:
        shutil.copytree(out_dir, keep / out_dir.name, dirs_exist_ok=True)
    return window_events(out_dir)


def misses(ev: dict[str, int]) -> tuple[int, int]:
    """(first-level misses, last-level misses) of a window's events."""
    return ev["I1mr"] + ev["D1mr"] + ev["D1mw"], ev["ILmr"] + ev["DLmr"] + ev["DLmw"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--first", type=int, default=1600)
    ap.add_argument("--last", type=int, default=2000)
    ap.add_argument("--width", type=int, default=None, help="the program's width (default: its own)")
    ap.add_argument("--layers", type=int, default=None, help="the program's layers (default: its own)")
    ap.add_argument("--program", choices=sorted(SETUP), default="proxy",
                    help="proxy: the issue's CPU proxy; cell-loop: a GRUCell called 32 times a step, and a head; "
                         "causal-lm: a nanoGPT-style causal Transformer in bf16 (bench/steady_programs.py)")
    ap.add_argument("--parts", default="all,none",
                    help="variants: all (the full audit), none (every part off), a part's name (the audit "
                         f"without it: {', '.join(PARTS)}), no-numerics, no-profile")
    ap.add_argument("--cache", type=int, default=None, metavar="BYTES",
                    help="also simulate the caches (callgrind --cache-sim, first level as valgrind reads the "
                         "machine's) with a last level of BYTES (16-way, 64-byte lines; give one core's L2 "
                         "to see what the audit's work evicts of the program's there) and print the misses "
                         "per iteration: what instructions alone cannot show")
    ap.add_argument("--keep", type=Path, default=None,
                    help="copy the window's callgrind dumps to KEEP/VARIANT/ (callgrind_annotate reads them: "
                         "which functions the audit's instructions went to)")
    args = ap.parse_args()
    cache = ["--cache-sim=yes", f"--LL={args.cache},16,64"] if args.cache else []
    for tool in ("valgrind", "cc"):
        if shutil.which(tool) is None:
            sys.exit(f"this bench needs {tool} (and valgrind's headers, valgrind/callgrind.h)")
    n = args.last - args.first
    env = bench_env()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        (tmp_path / "count.c").write_text(HELPER)
        helper = tmp_path / "count.so"
        c = subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(helper), str(tmp_path / "count.c")],
                           capture_output=True, text=True)
        if c.returncode != 0:
            sys.exit(f"could not build the counting helper (valgrind's headers?): {c.stderr.strip()}")
        prog = tmp_path / "proxy.py"
        prog.write_text(PROGRAM.format(setup=setup(args.program, args.width, args.layers, "cpu"), steps=args.steps,
                                       first=args.first, last=args.last))
        plain_ev = run([sys.executable, str(prog), str(helper)], tmp_path / "plain", env, tmp_path, cache, args.keep)
        plain = plain_ev["Ir"] / n
        print(f"plain              {plain / 1e6:8.3f} M instructions/iteration", flush=True)
        if cache:
            m1, ml = misses(plain_ev)
            print(f"                   {m1 / n / 1e3:8.1f} k first-level, {ml / n / 1e3:8.1f} k last-level misses/iteration")
        counted: dict[str, float] = {}
        for v in args.parts.split(","):
            venv, flags = variant(v, env, PARTS)
            cmd = [sys.executable, "-m", "auditor", "run", str(prog), "--steps", str(args.steps), "--to-end", "-q",
                   "--out", str(tmp_path / f"audit-{v}"), *flags, "--", str(helper)]
            ev = run(cmd, tmp_path / f"vg-{v}", venv, tmp_path, cache, args.keep)
            counted[v] = ev["Ir"] / n
            line = f"{label(v):18s} {counted[v] / 1e6:8.3f} M instructions/iteration: {counted[v] / plain:.4f}x plain"
            if v in PARTS and "all" in counted and counted["all"] > plain:
                line += f"; the part's share of the audit's cost: {100 * (counted['all'] - counted[v]) / (counted['all'] - plain):+.0f}%"
            print(line, flush=True)
            if cache:
                (p1, pl), (a1, al) = misses(plain_ev), misses(ev)
                print(f"                   {a1 / n / 1e3:8.1f} k first-level ({a1 / p1:.3f}x plain), "
                      f"{al / n / 1e3:8.1f} k last-level misses/iteration ({al / pl:.3f}x plain)", flush=True)
    print(f"\n{describe(args.program, args.width, args.layers)}, 1 thread; instructions (all threads "
          f"of the program's process) over iterations {args.first}-{args.last - 1} of {args.steps}, callgrind")


if __name__ == "__main__":
    main()
