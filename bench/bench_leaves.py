"""Numerics checking cost per library leaf module, where Python overhead dominates.

Why: examples/clean.py has 6 leaf modules around large kernels; a real model has hundreds of
small ones, and there the fixed cost per checked call is what a user pays. Twin models (same seed)
of 50 x (Linear(32, 32), ReLU) step in turns in one process, one checked (collector on, mode
pushed), the other not; the median per-pair difference in thread CPU time, divided by the 100 leaf
calls, is the cost per leaf (its forward check plus its share of the backward, optimizer and
step-end work). The twins' weights must stay equal.

    python bench/bench_leaves.py [--steps 300] [--blocks 50]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch import nn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--blocks", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from auditor.capture import probes
    from auditor.capture.numerics import collector as numerics

    probes.install()
    col = numerics.Numerics()
    col.install()

    def make():
        torch.manual_seed(0)
        m = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(args.blocks)])
        return m, torch.optim.SGD(m.parameters(), lr=1e-3)

    a, b = make(), make()
    x = torch.randn(8, 32)

    def step(mo):
        m, opt = mo
        opt.zero_grad(set_to_none=True)
        m(x).sum().backward()
        opt.step()

    on, off = [], []
    for i in range(args.steps + 20):
        t0 = time.thread_time()
        col.step_begin(i)
        step(a)
        col.step_end(i)
        t1 = time.thread_time()
        col.checking = False
        step(b)
        t2 = time.thread_time()
        col.checking = True
        if i >= 20:
            on.append(t1 - t0)
            off.append(t2 - t1)
    d = statistics.median(p - q for p, q in zip(on, off))
    leaves = 2 * args.blocks
    same = all(torch.equal(p, q) for p, q in zip(a[0].parameters(), b[0].parameters()))
    print(f"{leaves} leaf calls per step: checked {statistics.median(on) * 1e3:.2f} ms, "
          f"unchecked {statistics.median(off) * 1e3:.2f} ms CPU; {d * 1e6 / leaves:.1f} us per leaf; "
          f"weights equal: {same}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
