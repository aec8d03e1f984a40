"""A step that makes its own torch calls (no nn layers): about 150 of them in the forward, as a hand-written
attention, a gradient penalty or a custom loss does. Each goes through the numerics' torch-function
mode, unlike the calls inside library layers: `bench_step_overhead.py --trainer bench/many_calls.py`
measures what that costs."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Module()
model.w = nn.Parameter(torch.randn(64, 64) / 8)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(32, 64)


def step(i):
    h = x
    for _ in range(50):
        h = torch.tanh(h @ model.w) * 0.5
    loss = h.pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
