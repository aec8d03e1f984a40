"""A loop that evaluates every 4 steps and saves a checkpoint every 8: work between the steps.

    python eval_and_save.py [--steps N] [--ckpt-dir DIR]
"""
import argparse
import os
import tempfile
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def evaluate(model, loader):
    model.eval()
    total = 0.0
    with torch.no_grad():
        for x, y in loader:
            total += nn.functional.cross_entropy(model(x), y).item()  # expect: work-between-steps
    model.train()
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--ckpt-dir", default=None)
    args = ap.parse_args()
    out = args.ckpt_dir or tempfile.mkdtemp()
    torch.manual_seed(0)
    train = DataLoader(TensorDataset(torch.randn(2048, 128), torch.randint(0, 4, (2048,))), batch_size=32)
    val = DataLoader(TensorDataset(torch.randn(4096, 128), torch.randint(0, 4, (4096,))), batch_size=256)
    model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    t0 = time.perf_counter()
    for k, (x, y) in enumerate(train):
        if k == args.steps:
            break
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if k % 4 == 3:
            evaluate(model, val)
        if k % 8 == 7:
            torch.save(model.state_dict(), os.path.join(out, "model.pt"))
    print(f"wall {time.perf_counter() - t0:.3f} s for {args.steps} steps")


if __name__ == "__main__":
    main()
