"""A CUDA training loop that appends each batch's output, with its graph, to a module-level list:
every step's output stays alive until the device is full ("OOM on the second batch"). Set
PREDS_LEAK_CLEAN=1 for the clean twin, which keeps each batch's mean as a Python float."""
import os

import torch
from torch import nn

torch.manual_seed(0)
device = "cuda"
model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 4096)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
clean = os.environ.get("PREDS_LEAK_CLEAN") == "1"
preds = []

for step in range(12):
    x = torch.randn(1024, 512, device=device)
    out = model(x)
    loss = out.square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if clean:
        preds.append(out.mean().item())
    else:
        preds.append(out)  # FILL LINE: each batch's output, with its graph
