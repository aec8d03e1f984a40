"""A running metric that re-concatenates every past batch each step: the concatenation (and the
mean over it) grows with the run, outside the forward, backward and optimizer phases, so each step
is slower than the last at that line."""
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
features = torch.randn(512, 64).repeat(4, 1)
history = []


def step(i):
    x = features[(i % 4) * 512:(i % 4 + 1) * 512]
    y = (x[:, 0] > 0).long()
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    history.append(x.repeat(4, 1))
    drift = torch.cat(history).mean(0).abs().sum()  # expect: step-slowdown
    return drift
