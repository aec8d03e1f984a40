"""A balanced DDP trainer: every rank loads, computes and syncs the same amount each step.
`audit run examples/ddp_balanced.py:step --nproc-per-node 2` reports nothing at warning level.

The sleep stands in for the accelerator's share of the step. These examples run on CPU-only
machines, where a model's own compute would make each rank as fast as whatever else the machine is
running lets it be (a real straggler, which rank-straggler would then rightly report)."""
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_common import Batches, init_distributed, loader_for, mlp, synthetic

DEVICE_S = 0.04

rank, world = init_distributed()
model = DDP(mlp())
opt = torch.optim.SGD(model.parameters(), lr=0.01)
batches = Batches(loader_for(synthetic(), rank, world))


def step(i):
    x, y = batches.next()
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    time.sleep(DEVICE_S)  # the device computing forward and backward
    loss.backward()
    opt.step()
