"""An epoch loop whose DataLoader starts its two workers again every epoch (no
persistent_workers): 8 batches an epoch, so the workers' start comes every 8 steps.

    python epoch_restarts.py [--epochs N]
"""
import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=6)
    args = ap.parse_args()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 32), torch.randint(0, 4, (64,)))
    loader = DataLoader(data, batch_size=8, shuffle=True, num_workers=2)  # expect: worker-restarts
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    t0 = time.perf_counter()
    steps = 0
    for epoch in range(args.epochs):
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(0.003)
            steps += 1
    print(f"wall {time.perf_counter() - t0:.3f} s for {steps} steps")


if __name__ == "__main__":
    main()
