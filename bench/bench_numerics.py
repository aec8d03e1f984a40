"""What the numerics collector costs per step on a clean training step of about 10 ms.

    python bench/bench_numerics.py [--steps N] [--rounds R] [--threads T] [--width W] [--batch B]

Two measurements of the same seeded MLP step (AdamW, cross-entropy):

* paired, in one process (the robust number on a loaded machine): the collector installed, and
  two identical models stepped in turn, one always checked (mode pushed, hooks active), its twin
  never (checking off); the median of the per-pair differences in thread CPU time is its cost. The
  twins' weights are compared at the end: the checks must not change what is computed.
* separate processes (what an audit adds, noisier): `plain` (the step alone), `probes` (the probes
  every audit installs) and `numerics` (probes plus the collector), one fresh process each,
  in alternating rounds, median step times in wall and thread CPU time.

Also printed: the collector's own measure of its checking time (`check_ms`) and the torch calls
it checked per step. The goal is under 10% of the step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CONFIGS = ("plain", "probes", "numerics")


def worker(config: str, steps: int, threads: int, width: int, batch: int) -> dict:
    """One configuration: build a seeded MLP classifier step, time `steps` calls after warm-up."""
    import torch
    from torch import nn

    torch.set_num_threads(threads)
    col = None
    if config in ("probes", "numerics", "paired"):
        from auditor.capture import probes

        probes.install()
    if config in ("numerics", "paired"):
        from auditor.capture.numerics.collector import Numerics

        col = Numerics()
        col.install()
    def make_step():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                              nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss_fn = nn.CrossEntropyLoss()
        data = [(torch.randn(batch, 256), torch.randint(0, 10, (batch,))) for _ in range(8)]

        def step(i: int) -> None:
            x, y = data[i % len(data)]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
        step.model = model
        return step

    step = make_step()
    if config == "paired":
        # a twin that is never checked: stepping one model with checks on and off would make every
        # checked step re-measure weights the unchecked step changed, which no audit ever does
        twin = make_step()
        out = paired(col, step, twin, steps)
        assert all(torch.equal(p, q) for p, q in zip(step.model.parameters(), twin.model.parameters())), \
            "checked and unchecked twins diverged: the collector changed the computation"
        return out
    times, cpu, checks, ops = [], [], [], []
    for i in range(steps + 5):
        t0, c0 = time.perf_counter(), time.thread_time()
        if col is not None:
            col.step_begin(i)
        step(i)
        if col is not None:
            d = col.step_end(i)
            checks.append(d["check_ms"])
            ops.append(d["ops"])
        if i >= 5:  # warm-up left out
            times.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.thread_time() - c0) * 1e3)
    return {"config": config, "median_ms": statistics.median(times), "cpu_ms": statistics.median(cpu),
            "check_ms": statistics.median(checks[5:]) if checks else None,
            "ops": statistics.median(ops) if ops else None}


def paired(col, step, twin, steps: int) -> dict:
    """Each step of the checked model, then the same step of its unchecked twin. Median of the CPU
    differences."""
    on, off, diffs, checks = [], [], [], []
    for i in range(steps + 5):
        c0 = time.thread_time()
        col.step_begin(i)
        step(i)
        d = col.step_end(i)
        c1 = time.thread_time()
        col.checking = False  # hooks return at once; the mode is not pushed
        twin(i)
        c2 = time.thread_time()
        col.checking = True
        if i >= 5:
            on.append((c1 - c0) * 1e3)
            off.append((c2 - c1) * 1e3)
            diffs.append((c1 - c0 - (c2 - c1)) * 1e3)
            checks.append(d["check_ms"])
    return {"config": "paired", "on_ms": statistics.median(on), "off_ms": statistics.median(off),
            "diff_ms": statistics.median(diffs), "check_ms": statistics.median(checks), "ops": d["ops"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--worker", choices=(*CONFIGS, "paired"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps, args.threads, args.width, args.batch)))
        return
    out = subprocess.run([sys.executable, __file__, "--worker", "paired", "--steps", str(args.steps * args.rounds),
                          "--threads", str(args.threads), "--width", str(args.width), "--batch", str(args.batch)],
                         capture_output=True, text=True, check=True)
    p = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"paired, one process ({args.steps * args.rounds} pairs): checked {p['on_ms']:.2f} ms, off {p['off_ms']:.2f} ms "
          f"CPU per step; cost {p['diff_ms']:+.2f} ms ({p['diff_ms'] / p['off_ms']:+.1%}); check_ms {p['check_ms']:.2f}\n")
    results: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    for r in range(args.rounds):
        for c in CONFIGS if r % 2 == 0 else reversed(CONFIGS):
            out = subprocess.run([sys.executable, __file__, "--worker", c, "--steps", str(args.steps),
                                  "--threads", str(args.threads), "--width", str(args.width),
                                  "--batch", str(args.batch)], capture_output=True, text=True, check=True)
            results[c].append(json.loads(out.stdout.strip().splitlines()[-1]))
    check = statistics.median(r["check_ms"] for r in results["numerics"])
    ops = statistics.median(r["ops"] for r in results["numerics"])
    print(f"{'config':10} {'wall ms/step':>13} {'CPU ms/step':>12}   CPU per round")
    for c in CONFIGS:
        wall = statistics.median(r["median_ms"] for r in results[c])
        cpu = statistics.median(r["cpu_ms"] for r in results[c])
        print(f"{c:10} {wall:13.2f} {cpu:12.2f}   " + " ".join(f"{r['cpu_ms']:.2f}" for r in results[c]))
    # CPU time of the step's thread: what the checks cost, whatever else loads the machine.
    med = {c: statistics.median(r["cpu_ms"] for r in results[c]) for c in CONFIGS}
    over = med["numerics"] - med["probes"]
    print(f"\nnumerics collector over probes: {over:+.2f} ms/step ({over / med['probes']:+.1%} CPU); "
          f"over plain: {med['numerics'] - med['plain']:+.2f} ms ({(med['numerics'] - med['plain']) / med['plain']:+.1%})")
    print(f"its own checking time (check_ms, wall): {check:.2f} ms/step, {ops:.0f} torch calls checked per step; "
          f"threads={args.threads}, width={args.width}, batch={args.batch}")


if __name__ == "__main__":
    main()
