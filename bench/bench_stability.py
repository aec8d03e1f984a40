"""Stability of the timing verdicts under load: the same example audited N times while K other
CPU-bound processes run (busy loops, one per process), and the findings of each audit compared.

A verdict that depends on timing (dataloader-bound, step-slowdown, forced-cleanup's cost ...) must
come out the same in every run: the script prints, per run, the (rule, severity, line) set it
found, and how many runs agree with the most common set.

    python bench/bench_stability.py [--target examples/dataloader_bound.py:step] [--runs 10] [--load 2] [--steps 30]
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

ROOT = Path(__file__).resolve().parents[1]


def _busy() -> None:
    x = 0
    while True:
        x = (x * 31 + 7) % 1000003


def verdicts(out: Path) -> tuple[tuple[str, str, int | None], ...]:
    doc = json.loads((out / "findings.json").read_text())
    return tuple(sorted((f["rule"], f["severity"], f["locations"][0]["line"] if f["locations"] else None)
                        for f in doc["findings"]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="examples/dataloader_bound.py:step")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--load", type=int, default=2, help="CPU-bound processes running beside the audits")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    load = [mp.Process(target=_busy, daemon=True) for _ in range(args.load)]
    for p in load:
        p.start()
    results, extra = [], []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for k in range(args.runs):
                out = Path(tmp) / f"run-{k}"
                t0 = time.perf_counter()
                p = subprocess.run([sys.executable, "-m", "auditor", "run", args.target, "--steps", str(args.steps),
                                    "--quiet", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
                wall = time.perf_counter() - t0
                if not (out / "findings.json").exists():
                    print(f"run {k}: failed (exit {p.returncode}): {p.stderr[-500:]}")
                    continue
                v = verdicts(out)
                results.append(v)
                doc = json.loads((out / "findings.json").read_text())
                conf = {f["rule"]: f["evidence"].get("confidence") for f in doc["findings"]
                        if isinstance(f.get("evidence"), dict) and f["evidence"].get("confidence")}
                extra.append(conf)
                print(f"run {k}: {wall:.1f} s, load avg {os.getloadavg()[0]:.1f}, median step "
                      f"{doc['steps']['median_ms']:.2f} ms: {[f'{r}:{s}@{ln}' for r, s, ln in v]}"
                      + (f" confidence {conf}" if conf else ""))
    finally:
        for p in load:
            p.terminate()
    if not results:
        return
    common, n = Counter(results).most_common(1)[0]
    print(f"\n{args.target}, {args.runs} audits of {args.steps} steps beside {args.load} CPU-bound processes: "
          f"{n} of {len(results)} gave the same findings {[f'{r}:{s}@{ln}' for r, s, ln in common]}")


if __name__ == "__main__":
    main()
