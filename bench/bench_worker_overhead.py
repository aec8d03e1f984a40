"""What an audit costs a program's DataLoader workers: each worker's time a batch, plain and audited.

The program is pytorch/examples mnist's input pipeline without torchvision: 28x28 uint8 images made
into float tensors, scaled and normalised one sample at a time (`ToTensor`'s torch calls, and a
`Normalize` module, as torchvision's is an nn.Module), batches of 64 collated in one worker process,
and a small model trained on them. The
program times each batch in its worker itself (its own wrapper around torch's fetcher: the
dataset's `__getitem__` and the collate, CPU time on the worker's thread), and writes the median.
Each round runs it plain, under `audit run` (a CPU program) and, with `--rehearse`, as a CUDA
program rehearsed on this CPU (`-- cuda`); the figure is each variant's median over rounds against
the plain runs' median. The worker's time is its own: the training process's load on the other
cores moves it little (CPU time on its thread).

    python bench/bench_worker_overhead.py [--rounds 5] [--steps 60] [--rehearse]
    PYTHONPATH=/path/to/older/checkout python bench/bench_worker_overhead.py ...   (another version's audit)
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

PROGRAM = """\
import json, sys, time
import torch
import torch.nn.functional as F
import torch.utils.data._utils.fetch as fetch
from torch import nn
from torch.utils.data import DataLoader, Dataset

DEVICE = sys.argv[1]  # "cuda": rehearsed on a CPU-only machine
OUT = sys.argv[2]
MEAN, STD = torch.tensor([0.1307]).view(1, 1, 1), torch.tensor([0.3081]).view(1, 1, 1)
torch.manual_seed(0)
IMAGES = torch.randint(0, 256, (4096, 28, 28), dtype=torch.uint8)

# the worker's own account of its batches (installed before the workers are forked)
own = fetch._MapDatasetFetcher.fetch
times = []


def timed(self, index):
    t = time.thread_time()
    batch = own(self, index)
    times.append((time.thread_time() - t) * 1e3)
    if len(times) == 40:
        with open(OUT, "w") as f:
            json.dump(statistics_median(times[5:]), f)
    return batch


def statistics_median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


fetch._MapDatasetFetcher.fetch = timed


class Normalize(nn.Module):  # (torchvision's Normalize is an nn.Module too)
    def forward(self, x):
        return x.sub(MEAN).div(STD)


class Digits(Dataset):
    def __init__(self):
        self.normalize = Normalize()

    def __len__(self):
        return len(IMAGES)

    def __getitem__(self, i):
        x = IMAGES[i].view(1, 28, 28).to(torch.float32).div(255)  # ToTensor
        return self.normalize(x), int(i % 10)


loader = DataLoader(Digits(), batch_size=64, num_workers=1, shuffle=True, persistent_workers=True)
model = nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10)).to(DEVICE)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step, (x, y) in enumerate(loader):
    loss = F.cross_entropy(model(x.to(DEVICE)), y.to(DEVICE))
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.02)  # a step longer than a batch: the worker is never hurried
    if step == {steps}:
        break
"""


def run(workdir: Path, variant: str, steps: int, n: int) -> float:
    prog = workdir / "prog.py"
    prog.write_text(PROGRAM.replace("{steps}", str(steps)))
    out = workdir / f"{variant}{n}.json"
    device = "cuda" if variant == "rehearsed" else "cpu"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if variant == "plain":
        cmd = [sys.executable, str(prog), device, str(out)]
    else:
        cmd = [sys.executable, "-m", "auditor", "run", str(prog), "--steps", str(steps), "--to-end", "--quiet",
               "--out", str(workdir / f"audit-{variant}{n}"), "--", device, str(out)]
    subprocess.run(cmd, check=True, env=env, cwd=workdir, capture_output=True)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rehearse", action="store_true", help="also a run rehearsed as a CUDA program")
    a = ap.parse_args()
    variants = ["plain", "audited"] + (["rehearsed"] if a.rehearse else [])
    got: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(a.rounds):
            for v in variants:
                got[v].append(run(Path(tmp), v, a.steps, n))
    plain = statistics.median(got["plain"])
    print(f"worker CPU ms a batch of 64, median of {a.rounds} rounds (each run's median batch):")
    for v in variants:
        m = statistics.median(got[v])
        print(f"  {v:9s} {m:6.3f} ms  x{m / plain:.3f}  (runs: {', '.join(f'{x:.3f}' for x in got[v])})")


if __name__ == "__main__":
    main()
