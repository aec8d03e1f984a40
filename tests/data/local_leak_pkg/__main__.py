"""A training loop inside a function that keeps a running sum of the loss tensor (not of
`loss.item()`) in a local: every step's graph stays reachable from `total`. Set LOCAL_LEAK_CLEAN=1
for the clean twin (`total += loss.item()`)."""
import os

import torch
from torch import nn


def train(steps: int = 40) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    clean = os.environ.get("LOCAL_LEAK_CLEAN") == "1"
    total = 0.0
    for _ in range(steps):
        x = torch.randn(128, 64)
        loss = (model(x) - 1).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if clean:
            total += loss.item()
        else:
            total += loss  # LEAK LINE: the running sum keeps every step's graph
    return float(total)


if __name__ == "__main__":
    train()
