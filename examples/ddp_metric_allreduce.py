"""Logging the mean loss across ranks in every step: an all-reduce of one float per step, then
`.item()`. Each step gains a lockstep point where every rank waits for the slowest, and a host sync.
`audit run examples/ddp_metric_allreduce.py:step --nproc-per-node 2` flags the all-reduce line."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_common import Batches, init_distributed, loader_for, mlp, synthetic

rank, world = init_distributed()
model = DDP(mlp())
opt = torch.optim.SGD(model.parameters(), lr=0.01)
batches = Batches(loader_for(synthetic(), rank, world))
history = []


def step(i):
    x, y = batches.next()
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)  # expect: collective-wait
    history.append(mean_loss.item() / world)
