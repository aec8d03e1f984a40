"""Where an audit's steady-state cost goes, part by part, as the program's own clock sees it.

    python bench/bench_steady_parts.py [--rounds 3] [--steps 160] [--first 40] [--last 140]
                                       [--parts all,probes,hooks,...] [--program proxy] [--device cpu]
                                       [--width W] [--layers L] [--keep DIR]
                                       [--window FIRST:LAST ...] [--cpus 2,3]

The program is by default the issue's CPU proxy of a host-bound step: 40 tiny Linear+LayerNorm+GELU
layers, a batch of 16, AdamW, one thread (`OMP_NUM_THREADS=1`); `--program cell-loop` (a GRUCell
called 32 times a step), `causal-lm` (a nanoGPT-style causal Transformer in bf16, whose attention
makes -inf on every step) and `tiny-calls` (900 tiny calls a step on one 8-element tensor, SGD: a
checked step costs ~3 steps, so the checks' spacing shows), `many-forwards` (50 outermost calls of a
small MLP a step) and `dqn` (a DQN update: 8 acting calls, a no-grad target pass) are the others
(bench/steady_programs.py). `--device cuda` runs it on the
GPU, a host-bound GPU step, each iteration's clock read synchronised with the device. It is a plain
script that times each of its own iterations (the interval between one iteration's start and the
next's: everything the audit adds at a step boundary, the graph scans and step records included). Each round runs it plain, then
under `audit run PROG --steps S --to-end` (defaults: numerics checks and profiler on), then plain
again before the next audited variant, and so on: each variant leaves one part out through the
internal switch `AUDITOR_BENCH_OFF` (auditor/capture/bench_switches.py):

  probes   the probes' wrappers on torch calls      hooks    numerics' module hooks, unchecked steps
  lines    the line sampler                         scans    the graph scans at step boundaries
  records  the step records sent to the parent      watch    the loss watch of unchecked steps
  checks   the numerics checks at one step in 32 after the dense start

Each full audit's iterations are also split by what ran in them (its evidence.json says which
steps were checked, which the line sampler looked at, which a graph scan followed): the CPU time
each kind of iteration spent over the plain run's median iteration, summed over FIRST..LAST-1 and
given as a share of the plain run's time there (the plain run's own spikes over its median taken
from "other", so that the kinds add up to the run's cost). Spikes (a scan, a checked step) stand out
of the machine's noise this way; "other" is the per-step cost of the probes and records and the
drift between the two processes. The step boundary's own time (the gap between one step's end and
the next's start in the audited process's records: the step records, the loss watch, the hooks that
cross it) is printed too: measured in one process, it is free of that drift. So are the parts the
audited run's own records separate ("inside": its checked and sampled steps and its graph scans
over its own median unmarked step, and its boundaries); the probes' hooks inside every step show
only against the plain run.

A run's figure is its mean interval over iterations FIRST..LAST-1 (the steady state: the rare
checked step and graph scan count there, as they do in a long run); a variant's cost is the median
over rounds of its run's figure divided by the median of the plain runs' (the ratio of medians),
and a part's share is how much of the full audit's cost over plain goes when it is left out.
Each audited run also prints what the audit itself reported: the steps it checked in the window
(a run whose checks alarmed checks every step), its step time and clock, and its findings' rules.
Separate processes, so the machine's drift shows: read the plain runs' range it prints.
`--window FIRST:LAST` (repeatable) prints the same ratio of medians over other spans of the same runs
(a long run's later stretch, where the checks run one step in 64, then 128: numerics/schedule.py);
`--cpus` pins every run to these CPUs (a many-core GPU machine's scheduler otherwise moves a process
between cores, and its plain runs drift by a third).

Two measures inside one audited process, free of that drift:
`--toggle BLOCK[:PART,...]` runs the audits with the parts named (default: every per-step part) left
out in every other block of BLOCK steps (AUDITOR_BENCH_TOGGLE): the ratio of the blocks with them to
the blocks without (each block's first two iterations left out, each block without them against the
mean of its two neighbours, median over blocks) is what the parts cost the steady state, and the
blocks without them against the plain run is what is left (the audited process's own footprint, the
step finder, the phase probes, and the drift between processes);
`--toggle BLOCK:rotate` leaves one per-step part out at a time (probes, hooks, records, watch), each in
its turn of a cycle of blocks that starts with a block with every part: each part's cost is the
median unmarked iteration of the blocks with every part over its own block's, median over blocks;
`--window-at N` starts the profiler window at step N (AUDITOR_BENCH_WINDOW_AT): the median unmarked
iteration of the WIDTH after the window against the WIDTH before it (`--width-around`, default 200) is
what the window leaves behind it (on a GPU: CUPTI still subscribed would show there).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from steady_programs import SETUP, describe, setup

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from auditor.capture.bench_switches import ROTATED  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("probes", "hooks", "lines", "scans", "records", "watch", "checks")

PROGRAM = """\
import json, sys, time
import torch
from torch import nn

torch.manual_seed(0)
{setup}
{sync}
times = []
for i in range({steps}):
    sync()
    times.append((time.perf_counter(), time.process_time()))
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
sync()
times.append((time.perf_counter(), time.process_time()))
with open(sys.argv[1], "w") as f:
    json.dump([[(b[k] - a[k]) * 1e3 for k in (0, 1)] for a, b in zip(times, times[1:])], f)
"""


def steady(path: Path, first: int, last: int) -> tuple[float, float]:
    """(wall, CPU): the mean ms per iteration over iterations first..last-1."""
    times = json.loads(path.read_text())[first:last]
    return statistics.mean(t[0] for t in times), statistics.mean(t[1] for t in times)


def marks(ev: dict) -> tuple[set[int], set[int], set[int]]:
    """The audited run's marked iterations, by its evidence: those a graph scan touches (the one it
    follows and the next: it runs at the boundary), those checked, those the line sampler looked at."""
    return ({s["after_step"] + k for s in ev["graph_scans"] for k in (0, 1)},
            {s["index"] for s in ev["steps"] if s.get("numerics") is not None},
            {s["index"] for s in ev["steps"] if s.get("lines_sampled")})


def split(times_path: Path, evidence_path: Path, plain: list[float], first: int, last: int) -> dict[str, float]:
    """CPU ms over the plain run's median iteration (`plain`: its CPU ms per iteration), summed by
    kind over iterations first..last-1: "scan" (the iteration a graph scan follows and the next:
    the scan runs at the boundary), "checked" (the numerics checks), "sampled" (the line sampler),
    "other" (less the plain run's own iterations over its median: the kinds sum to the difference
    of the two runs' totals)."""
    plain_median = statistics.median(plain[first:last])
    cpu = [t[1] for t in json.loads(times_path.read_text())]
    scans, checked, sampled = marks(json.loads(evidence_path.read_text()))
    out = dict.fromkeys(("scan", "checked", "sampled", "other"), 0.0)
    for i in range(first, last):
        kind = "scan" if i in scans else "checked" if i in checked else "sampled" if i in sampled else "other"
        out[kind] += cpu[i] - plain_median
    out["other"] -= sum(t - plain_median for t in plain[first:last])
    return out


def inside(evidence_path: Path, first: int, last: int) -> tuple[float, dict[str, float]]:
    """What the audited process's own records measure, free of the drift between processes (no
    plain run): the median step boundary in us (the wall time between one step's end and the next's
    start: the step records, the loss watch, the hooks that cross it, outside both steps' times; with
    --device cuda it also holds the program's own synchronize, the wait for the step's last kernels),
    and the parts those records separate, each as a share of steps first..last-1 at its own median
    unmarked step's CPU time: the checked and the sampled steps' CPU over that median, the graph
    scans' time (the boundary each follows, over the median boundary) and the step boundaries.
    What the probes' hooks cost inside every step shows only against a plain run."""
    ev = json.loads(evidence_path.read_text())
    steps = {s["index"]: s for s in ev["steps"]}
    scans = {s["after_step"] for s in ev["graph_scans"]}
    span = [i for i in range(first, last) if i in steps and i + 1 in steps]
    if not span:  # (a run with its step records off sends none)
        return float("nan"), dict.fromkeys(("checked", "sampled", "scans", "boundary"), float("nan"))
    gap = {i: (steps[i + 1]["start_s"] - steps[i]["start_s"]) * 1e3 - steps[i]["ms"] for i in span}
    plain = [steps[i]["cpu_ms"] for i in span if steps[i].get("numerics") is None
             and not steps[i].get("lines_sampled") and i not in scans and i - 1 not in scans]
    median = statistics.median(plain or [steps[i]["cpu_ms"] for i in span])  # (every step marked: all of them)
    pct = median * len(span) / 100  # (1% of the span at the median step)
    boundary = statistics.median(gap.values())
    return boundary * 1e3, {
        "checked": sum(steps[i]["cpu_ms"] - median for i in span if steps[i].get("numerics") is not None) / pct,
        "sampled": sum(steps[i]["cpu_ms"] - median for i in span
                       if steps[i].get("lines_sampled") and steps[i].get("numerics") is None) / pct,
        "scans": sum(gap[i] - boundary for i in span if i in scans) / pct,
        "boundary": boundary * len(span) / pct}


def audit_said(out: Path, first: int, last: int) -> str:
    """What the audit itself reported: the steps it checked in first..last-1 (a run whose checks
    alarmed checks every step: a program that makes -inf by design must not), how many it timed,
    its median step on the clock of the step's bound, and its findings' rules."""
    ev = json.loads((out / "evidence.json").read_text())
    found = json.loads((out / "findings.json").read_text())
    checked = sum(1 for s in ev["steps"] if first <= s["index"] < last and s.get("numerics") is not None)
    steps = found["steps"]
    own, clock = steps["own_cost"], steps["clock"]
    rules = sorted({f["rule"] for f in found["findings"]})
    return (f"the audit: {checked} of {last - first} steps checked ({len(own['timed_steps'])} timed in all); "
            f"its step {clock['step_ms']} ms on the {clock['bound'] or 'host'}'s clock (host {clock['host_ms']}, "
            f"device {clock['device_ms']}); findings: {', '.join(rules) or 'none'}")


def toggled(times_path: Path, block: int, first: int, last: int,
            skip: range = range(0)) -> tuple[float, float, list[float]]:
    """(mean wall ms of the iterations with the parts, mean without, each block without them against
    its two neighbours' mean): the blocks of `block` iterations in first..last-1, odd blocks without
    the parts (bench_switches.off), each block's first two iterations left out (the swap), and those
    in `skip` (a profiler window moved into the span, and the steps after it)."""
    wall = [t[0] for t in json.loads(times_path.read_text())]
    blocks: dict[int, list[float]] = {}
    for i in range(first, min(last, len(wall))):
        if i % block >= 2 and i not in skip:
            blocks.setdefault(i // block, []).append(wall[i])
    means = {b: statistics.mean(v) for b, v in blocks.items() if len(v) >= max(1, (block - 2) // 2)}
    on = [means[b] for b in means if b % 2 == 0]
    off_ = [means[b] for b in means if b % 2 == 1]
    pairs = [(means[b - 1] + means[b + 1]) / 2 / means[b] for b in means
             if b % 2 == 1 and b - 1 in means and b + 1 in means]
    return (statistics.mean(on) if on else float("nan"), statistics.mean(off_) if off_ else float("nan"), pairs)


def around_window(times_path: Path, evidence_path: Path, at: int, width: int) -> tuple[float, float]:
    """(median wall ms of the unmarked iterations in the `width` before the window at step `at`,
    the same in the `width` after it): unmarked, not checked, not sampled, no scan at either edge."""
    wall = [t[0] for t in json.loads(times_path.read_text())]
    ev = json.loads(evidence_path.read_text())
    window = {s["index"] for s in ev["steps"] if s.get("profiled")}
    end = max(window, default=at + 2) + 1
    marked = set().union(*marks(ev), window)
    before = [wall[i] for i in range(max(0, at - 1 - width), at - 1) if i not in marked and i < len(wall)]
    after = [wall[i] for i in range(end + 2, end + 2 + width) if i not in marked and i < len(wall)]
    return (statistics.median(before) if before else float("nan"), statistics.median(after) if after else float("nan"))


def rotated(times_path: Path, evidence_path: Path, block: int, first: int, last: int,
            skip: range = range(0)) -> dict[str, list[float]]:
    """`--toggle BLOCK:rotate`: for each part of ROTATED, per cycle of blocks, the median unmarked
    iteration of the blocks with every part (the cycle's first and the next cycle's) over that of
    the block without the part: what the part costs each step, measured in one process. Unmarked:
    no check, no line sampling, no scan, not in `skip`, not a block's first two iterations."""
    wall = [t[0] for t in json.loads(times_path.read_text())]
    marked = set().union(*marks(json.loads(evidence_path.read_text())))
    turns = len(ROTATED) + 1
    blocks: dict[int, list[float]] = {}
    for i in range(first, min(last, len(wall))):
        if i % block >= 2 and i not in skip and i not in marked:
            blocks.setdefault(i // block, []).append(wall[i])
    med = {b: statistics.median(v) for b, v in blocks.items() if len(v) >= max(1, (block - 2) // 2)}
    out: dict[str, list[float]] = {p: [] for p in ROTATED}
    for b, ms in med.items():
        turn = b % turns
        start = b - turn
        if turn and start in med and start + turns in med:
            out[ROTATED[turn - 1]].append((med[start] + med[start + turns]) / 2 / ms)
    return out


FLAG_VARIANTS = ("no-numerics", "no-profile")  # variants that are an `audit run` flag


def bench_env() -> dict[str, str]:
    """The environment of every run: one thread, this checkout first on the caller's PYTHONPATH
    (a GPU machine's wheels stay found), no part left out."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    env.pop("AUDITOR_BENCH_OFF", None)
    return env


def label(v: str) -> str:
    """How variant `v` is named in a bench's table: a part's name is the audit without it."""
    return v if v in ("all", "none", *FLAG_VARIANTS) else "without " + v


def variant(v: str, env: dict[str, str], parts: tuple[str, ...] = PARTS) -> tuple[dict[str, str], list[str]]:
    """The environment and `audit run` flags of variant `v`: "all" (the full audit), "none" (every
    one of `parts` off), "no-numerics", "no-profile" (no profiler window), or a part's name (the audit without it)."""
    if v == "none":
        return {**env, "AUDITOR_BENCH_OFF": ",".join(parts)}, []
    if v in FLAG_VARIANTS:
        return dict(env), ["--" + v]
    return ({**env, "AUDITOR_BENCH_OFF": v} if v != "all" else dict(env)), []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--first", type=int, default=40)
    ap.add_argument("--last", type=int, default=140)
    ap.add_argument("--program", choices=sorted(SETUP), default="proxy",
                    help="proxy: the issue's CPU proxy; cell-loop: a GRUCell called 32 times a step; causal-lm: "
                         "a nanoGPT-style causal Transformer in bf16; many-forwards, dqn: many outermost "
                         "module calls a step (bench/steady_programs.py)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the program runs; on cuda each iteration's clock read is synchronised")
    ap.add_argument("--width", type=int, default=None, help="the program's width (default: its own)")
    ap.add_argument("--layers", type=int, default=None, help="the program's layers (default: its own)")
    ap.add_argument("--keep", type=Path, default=None,
                    help="copy each audited run's findings.json and evidence.json to KEEP/VARIANT-ROUND/")
    ap.add_argument("--window", action="append", default=[], metavar="FIRST:LAST",
                    help="also the ratio of medians over iterations FIRST..LAST-1 of the same runs (repeatable)")
    ap.add_argument("--cpus", default=None, help="pin every run to these CPUs, e.g. 2,3")
    ap.add_argument("--toggle", default=None, metavar="BLOCK[:PART,...]",
                    help="the audits leave the parts (default: all) out in every other block of BLOCK steps: "
                         "their cost measured inside one process")
    ap.add_argument("--window-at", type=int, default=None, metavar="N",
                    help="the profiler window starts at step N: the iterations after it against those before")
    ap.add_argument("--width-around", type=int, default=200, help="--window-at's iterations on each side")
    ap.add_argument("--parts", default="all," + ",".join(PARTS),
                    help="variants to run: all (the full audit), a part's name (the audit without it), "
                         "'none' (every part off), 'no-numerics', 'no-profile'")
    args = ap.parse_args()
    variants = args.parts.split(",")
    windows = [tuple(int(n) for n in w.split(":")) for w in args.window]
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})  # (the runs inherit it)
    env = bench_env()
    if args.toggle:
        env["AUDITOR_BENCH_TOGGLE"] = args.toggle
    if args.window_at is not None:
        env["AUDITOR_BENCH_WINDOW_AT"] = str(args.window_at)
    block = int(args.toggle.partition(":")[0]) if args.toggle else 0
    rotate = bool(args.toggle) and args.toggle.partition(":")[2] == "rotate"
    rotations: dict[str, list[float]] = {}  # --toggle BLOCK:rotate: part -> each of its blocks' ratio
    inproc: list[tuple[float, float, list[float], float]] = []  # --toggle: (with, without, pairs, plain)
    arounds: list[tuple[float, float]] = []  # --window-at: (before, after)
    spans: dict[str, list[list[float]]] = {"plain": [], **{v: [] for v in variants}}  # per window, wall ms
    plain: list[tuple[float, float]] = []
    audited: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    splits: list[dict[str, float]] = []  # the full audits' iterations by kind (split)
    boundaries: list[float] = []  # the full audits' median step boundary, us (inside)
    insides: list[dict[str, float]] = []  # the full audits' parts, in their own process (inside)
    with tempfile.TemporaryDirectory() as tmp:
        prog = Path(tmp) / "proxy.py"
        # (the CPU program names no torch.cuda call: one that did would be rehearsed as a CUDA program)
        sync = "sync = torch.cuda.synchronize" if args.device == "cuda" else "def sync():\n    pass"
        prog.write_text(PROGRAM.format(setup=setup(args.program, args.width, args.layers, args.device),
                                       sync=sync, steps=args.steps))
        times = Path(tmp) / "times.json"
        for r in range(args.rounds):
            for v in variants:
                subprocess.run([sys.executable, str(prog), str(times)], check=True, env=env, cwd=tmp)
                plain.append(steady(times, args.first, args.last))
                spans["plain"].append([steady(times, a, b)[0] for a, b in windows])
                plain_cpu = [t[1] for t in json.loads(times.read_text())]
                venv, flags = variant(v, env)
                times.unlink()
                a = subprocess.run([sys.executable, "-m", "auditor", "run", str(prog), "--steps", str(args.steps),
                                    "--to-end", "-q", "--out", str(Path(tmp) / "audit"), *flags, "--", str(times)],
                                   env=venv, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                if a.returncode != 0 or not times.exists():
                    sys.exit(f"audit of variant {v} failed: {a.stderr[-2000:]}")
                audited[v].append(steady(times, args.first, args.last))
                spans[v].append([steady(times, a, b)[0] for a, b in windows])
                if args.keep is not None:
                    kept = args.keep / f"{v}-{r}"
                    kept.mkdir(parents=True, exist_ok=True)
                    for name in ("findings.json", "evidence.json"):
                        shutil.copyfile(Path(tmp) / "audit" / name, kept / name)
                (pw, pc), (aw, ac) = plain[-1], audited[v][-1]
                print(f"round {r} {v:12s} plain {pw:7.3f} ms ({pc:.3f} CPU), audited {aw:7.3f} ms ({ac:.3f} CPU): "
                      f"{aw / pw:.3f}x wall, {ac / pc:.3f}x CPU", flush=True)
                print("    " + audit_said(Path(tmp) / "audit", args.first, args.last), flush=True)
                if windows:
                    print("    " + ", ".join(f"iterations {a}-{b - 1} {w / q:.3f}x wall" for (a, b), w, q in
                                           zip(windows, spans[v][-1], spans["plain"][-1])), flush=True)
                skip = range(args.window_at - 1, args.window_at + 8) if args.window_at is not None else range(0)
                if block and v == "all" and rotate:
                    per_part = rotated(times, Path(tmp) / "audit" / "evidence.json", block, args.first, args.last, skip)
                    for p, rs in per_part.items():
                        rotations.setdefault(p, []).extend(rs)
                    print(f"    in one process, blocks of {block}, one part out at a time: " + ", ".join(
                        f"{p} {statistics.median(rs):.3f}x ({len(rs)} blocks)" if rs else f"{p} -"
                        for p, rs in per_part.items()), flush=True)
                elif block and v == "all":
                    w_on, w_off, pairs = toggled(times, block, args.first, args.last, skip)
                    inproc.append((w_on, w_off, pairs, pw))
                    print(f"    in one process, blocks of {block}: with the parts {w_on:.3f} ms, without {w_off:.3f} ms: "
                          f"{w_on / w_off:.3f}x (per block {', '.join(f'{r:.3f}' for r in pairs)}); without them "
                          f"against plain {w_off / pw:.3f}x", flush=True)
                if args.window_at is not None:
                    arounds.append(around_window(times, Path(tmp) / "audit" / "evidence.json", args.window_at,
                                                 args.width_around))
                    b, a = arounds[-1]
                    print(f"    around the window at step {args.window_at}: median unmarked iteration before "
                          f"{b:.3f} ms, after {a:.3f} ms: {a / b:.3f}x", flush=True)
                if v != "all":
                    print(f"    the step boundary's median {inside(Path(tmp) / 'audit' / 'evidence.json', args.first, args.last)[0]:.0f} us",
                          flush=True)
                else:
                    splits.append(split(times, Path(tmp) / "audit" / "evidence.json", plain_cpu,
                                        args.first, args.last))
                    boundary, parts = inside(Path(tmp) / "audit" / "evidence.json", args.first, args.last)
                    boundaries.append(boundary)
                    insides.append(parts)
                    total = pc * (args.last - args.first)
                    print("    CPU over the plain median iteration, by kind: " + ", ".join(
                        f"{k} {ms:+.1f} ms ({100 * ms / total:+.1f}%)" for k, ms in splits[-1].items())
                        + f"; the step boundary's median {boundaries[-1]:.0f} us", flush=True)
                    print("    inside the audited process, over its own median unmarked step: " + ", ".join(
                        f"{k} {v:+.2f}%" for k, v in insides[-1].items()), flush=True)
    load = os.getloadavg()
    print(f"\n{describe(args.program, args.width, args.layers)}, {args.device}, 1 thread; mean ms/step over "
          f"iterations {args.first}-{args.last - 1} of {args.steps}; {args.rounds} round(s); load average now "
          f"{load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f}")
    if splits:
        total = statistics.median(t[1] for t in plain) * (args.last - args.first)
        print("full audit's CPU over the plain median iteration, median over rounds: " + ", ".join(
            f"{k} {100 * statistics.median(s[k] for s in splits) / total:+.1f}%" for k in splits[0]))
        plain_ms = statistics.median(t[0] for t in plain)
        b = statistics.median(boundaries)
        print(f"the step boundary (between one step's end and the next's start, in the audited process): median "
              f"{b:.0f} us, {100 * b / 1e3 / plain_ms:.1f}% of the plain median step")
        print("inside the audited process, over its own median unmarked step, median over rounds: " + ", ".join(
            f"{k} {statistics.median(d[k] for d in insides):+.2f}%" for k in insides[0]) + " (the probes' hooks "
            "inside every step show only against the plain run)")
    for k, clock in ((0, "wall"), (1, "CPU")):
        p = statistics.median(t[k] for t in plain)
        print(f"{clock}: plain median {p:.3f} ms/step (runs {min(t[k] for t in plain):.3f}-{max(t[k] for t in plain):.3f})")
        full = statistics.median(t[k] for t in audited["all"]) if "all" in audited else None
        for v, runs in audited.items():
            a = statistics.median(t[k] for t in runs)
            line = (f"  {label(v):16s} median {a:.3f} ms/step (runs {min(t[k] for t in runs):.3f}-"
                    f"{max(t[k] for t in runs):.3f}): {a / p:.3f}x plain")
            if full is not None and v in PARTS and full > p:
                line += f"; the part's share of the audit's cost: {100 * (full - a) / (full - p):+.0f}%"
            print(line)
    if inproc:
        pairs = [r for x in inproc for r in x[2]]
        print(f"in one process (--toggle {args.toggle}): the parts cost {statistics.median(x[0] / x[1] for x in inproc):.3f}x "
              f"by the runs' block means (per run {', '.join(f'{x[0] / x[1]:.3f}' for x in inproc)}), median over "
              f"{len(pairs)} blocks {statistics.median(pairs):.3f}x; the blocks without them against the round's "
              f"plain run {statistics.median(x[1] / x[3] for x in inproc):.3f}x")
    if rotations:
        print(f"in one process (--toggle {args.toggle}), each part's blocks against the blocks with every part, median "
              "over all runs' blocks: " + ", ".join(
                  f"{p} {statistics.median(rs):.3f}x ({len(rs)} blocks, {min(rs):.3f}-{max(rs):.3f})"
                  for p, rs in rotations.items() if rs))
    if arounds:
        print(f"around the window at step {args.window_at} (in one process): after/before "
              f"{statistics.median(a / b for b, a in arounds):.3f}x (per run {', '.join(f'{a / b:.3f}' for b, a in arounds)})")
    for k, (a, b) in enumerate(windows):
        p = statistics.median(w[k] for w in spans["plain"])
        print(f"iterations {a}-{b - 1}: plain median {p:.3f} ms/step wall; " + "; ".join(
            f"{label(v)} {statistics.median(w[k] for w in spans[v]) / p:.3f}x (per round "
            + ", ".join(f"{w[k] / q[k]:.3f}" for w, q in zip(spans[v], spans["plain"][i::len(variants)])) + ")"
            for i, v in enumerate(variants)))


if __name__ == "__main__":
    main()
