"""Gradient accumulation written as for one process: two micro-batches per optimizer step, each
backward all-reducing the gradients although only the last one needs to; and a constant buffer
(the input scaling) that DDP broadcasts before every forward although it never changes.
`audit run examples/ddp_accumulate.py:step` (one rank is enough to see it) flags both at the DDP line."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_common import Batches, init_distributed, loader_for, mlp, synthetic

ACCUM = 2


class Scaled(nn.Module):
    """An MLP behind a fixed input normalisation, kept as a buffer so it moves with .to(device)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.full((64,), 0.5))
        self.body = mlp()

    def forward(self, x):
        return self.body(x * self.scale)


rank, world = init_distributed()
model = DDP(Scaled())  # expect: ddp-config
opt = torch.optim.SGD(model.parameters(), lr=0.01)
batches = Batches(loader_for(synthetic(), rank, world, batch=64))


def step(i):
    opt.zero_grad(set_to_none=True)
    for _ in range(ACCUM):
        x, y = batches.next()
        loss = F.cross_entropy(model(x), y) / ACCUM
        loss.backward()
    opt.step()
