"""Stability of the timing verdicts under load: each example audited N times while K other CPU-bound
processes run (busy loops, one per process), and the findings of each audit compared.

A verdict that depends on timing (dataloader-bound, step-slowdown, forced-cleanup's cost ...) must
come out the same in every run: the script prints, per run, the (rule, severity, line) set it
found and each finding's cost and confidence; per example, how many runs agree with the most common
set (rule id + line), and the spread of each finding's cost (ms/step and share of the median step)
and of its stated confidence across the runs.

    python bench/bench_stability.py [--target examples/dataloader_bound.py:step ...] [--runs 10] [--load 2] [--steps 30]
                                    [--load-after SECONDS]

--load-after S starts the busy processes S seconds into each audit and stops them at its end: load that
arrives mid-run (a CI machine's other test worker), which lifts the last steps and not the first.

Without --target: examples/dataloader_bound.py, step_slowdown.py and forced_cleanup.py, the
bundled examples whose findings depend on timing.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("examples/dataloader_bound.py:step", "examples/step_slowdown.py:step", "examples/forced_cleanup.py:step")


def _busy() -> None:
    x = 0
    while True:
        x = (x * 31 + 7) % 1000003


def verdicts(doc: dict) -> tuple[tuple[str, str, int | None], ...]:
    return tuple(sorted((f["rule"], f["severity"], f["locations"][0]["line"] if f["locations"] else None)
                        for f in doc["findings"]))


def _key(f: dict) -> str:
    return f"{f['rule']}@{f['locations'][0]['line'] if f['locations'] else None}"


def spread(xs: list[float]) -> str:
    """median (min-max) of a list of numbers, and the max over the min."""
    if not xs:
        return "-"
    lo, hi = min(xs), max(xs)
    return f"{median(xs):.2f} ({lo:.2f}-{hi:.2f}" + (f", x{hi / lo:.2f}" if lo > 0 else "") + ")"


def start_load(n: int) -> list[mp.Process]:
    """`n` busy processes, started."""
    load = [mp.Process(target=_busy, daemon=True) for _ in range(n)]
    for p in load:
        p.start()
    return load


def audit_target(target: str, runs: int, steps: int, tmp: Path, load: int = 0, load_after: float | None = None) -> dict:
    """`audit run TARGET` `runs` times: each run's verdicts, costs and confidences, and a summary.
    With `load_after`, `load` busy processes start that many seconds into each run and stop at its end."""
    results, costs, shares, confs, loads, medians = [], {}, {}, {}, [], []
    for k in range(runs):
        out = tmp / f"{Path(target.split(':')[0]).stem}-{k}"
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, "-m", "auditor", "run", target, "--steps", str(steps),
                              "--quiet", "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        late: list[mp.Process] = []
        try:  # (communicate, not wait: it reads the pipes while it waits, so a full one blocks nothing)
            _, stderr = p.communicate(timeout=load_after)
        except subprocess.TimeoutExpired:
            late = start_load(load)
            _, stderr = p.communicate()
        for q in late:
            q.terminate()
        wall = time.perf_counter() - t0
        if not (out / "findings.json").exists():
            print(f"  run {k}: failed (exit {p.returncode}): {stderr[-500:]}")
            continue
        doc = json.loads((out / "findings.json").read_text())
        v = verdicts(doc)
        results.append(v)
        loads.append(os.getloadavg()[0])
        medians.append(doc["steps"]["median_ms"])
        shown = []
        for f in doc["findings"]:
            key, c = _key(f), f.get("cost") or {}
            if c.get("ms_per_step") is not None:
                costs.setdefault(key, []).append(c["ms_per_step"])
                shares.setdefault(key, []).append(c.get("share_of_step") or 0.0)
            conf = f["evidence"].get("confidence") if isinstance(f.get("evidence"), dict) else None
            if conf:
                confs.setdefault(key, Counter())[conf] += 1
            shown.append(key + (f" {c['ms_per_step']:.2f} ms" if c.get("ms_per_step") is not None else "")
                         + (f" {conf}" if conf else ""))
        print(f"  run {k}: {wall:.1f} s, load avg {loads[-1]:.1f}, median step {medians[-1]:.2f} ms: {shown}",
              flush=True)
    if not results:
        return {"target": target, "runs": 0}
    common, n = Counter(results).most_common(1)[0]
    return {"target": target, "runs": len(results), "same": n,
            "findings": [f"{r}@{ln}" for r, _, ln in common], "costs": costs, "shares": shares,
            "confidence": {k: dict(c) for k, c in confs.items()},
            "load": (min(loads), max(loads)), "median_step": (min(medians), max(medians))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", action="append", help="FILE:FUNC to audit (repeatable; default: %s)" % ", ".join(TARGETS))
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--load", type=int, default=2, help="CPU-bound processes running beside the audits")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--load-after", type=float, help="start the load this many seconds into each audit (stopped at "
                                                     "its end) rather than before all of them")
    args = ap.parse_args()
    targets = args.target or list(TARGETS)
    load = start_load(args.load) if args.load_after is None else []
    summaries = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for target in targets:
                print(f"{target}:", flush=True)
                summaries.append(audit_target(target, args.runs, args.steps, Path(tmp), args.load, args.load_after))
    finally:
        for p in load:
            p.terminate()
    when = f", from {args.load_after:g} s into each" if args.load_after is not None else ""
    print(f"\n{args.runs} audits of {args.steps} steps each beside {args.load} CPU-bound processes{when}:")
    for s in summaries:
        if not s["runs"]:
            print(f"{s['target']}: every run failed")
            continue
        print(f"{s['target']}: {s['same']} of {s['runs']} gave the same findings {s['findings']} (load avg "
              f"{s['load'][0]:.1f}-{s['load'][1]:.1f}, median step {s['median_step'][0]:.1f}-{s['median_step'][1]:.1f} ms)")
        for key in sorted(set(s["costs"]) | set(s["confidence"])):
            print(f"    {key}: cost ms/step {spread(s['costs'].get(key, []))}, share of the median step "
                  f"{spread(s['shares'].get(key, []))}, confidence {s['confidence'].get(key, {})}")


if __name__ == "__main__":
    main()
