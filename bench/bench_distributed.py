"""Overhead of the distributed probes (auditor.capture.probes.dist) on a DDP training step.

The probes add, per step: one Python hook call per parameter in backward, two autograd-engine
callbacks per synced backward, a wrapper around DDP.forward / _sync_buffers / _post_forward and
around each explicit collective, and a version-counter read per buffer at step boundaries. This
measures what that costs against the same step without them, in separate processes (the probes
patch torch globally), on a DDP job of one rank (gloo, in-memory store: no network noise), for a
model with few large parameters and one with many small ones (hook cost scales with their count).

    python bench/bench_distributed.py [--steps 60] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = r'''
import json, os, sys, time
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
torch.set_num_threads(1)
probes = None
if {probed}:
    from auditor.capture.probes.dist import DistProbes
    probes = DistProbes(); probes.install()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.manual_seed(0)
layers = [nn.Linear({width}, {width}) for _ in range({depth})]
model = DDP(nn.Sequential(*layers))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(64, {width})
times = []
for i in range({steps}):
    if probes: probes.step_begin(i)
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()
    dist.all_reduce(torch.ones(1))
    times.append((time.perf_counter() - t0) * 1e3)
    if probes: probes.step_end(i)
print(json.dumps(times[5:]))
'''
SHAPES = {"few large params (4 x 1024^2)": (1024, 4), "many small params (200 x 32^2)": (32, 200)}


def run(probed: bool, width: int, depth: int, steps: int) -> float:
    code = CHILD.format(probed=probed, width=width, depth=depth, steps=steps)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    return statistics.median(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    for label, (width, depth) in SHAPES.items():
        plain, probed = [], []
        for _ in range(args.repeats):  # interleaved, so drifting machine load hits both sides
            plain.append(run(False, width, depth, args.steps))
            probed.append(run(True, width, depth, args.steps))
        p, q = statistics.median(plain), statistics.median(probed)
        print(f"{label:32s} plain {p:8.3f} ms/step   probed {q:8.3f} ms/step   "
              f"overhead {q - p:+.3f} ms ({(q - p) / p:+.1%})")


if __name__ == "__main__":
    main()
