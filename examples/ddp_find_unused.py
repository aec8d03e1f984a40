"""`find_unused_parameters=True` "to be safe", while the model uses every parameter in every step:
DDP searches the autograd graph after each forward for nothing.
`audit run examples/ddp_find_unused.py:step --nproc-per-node 2` flags the DDP(...) line and
offers the edit that drops the keyword."""
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_common import Batches, init_distributed, loader_for, mlp, synthetic

rank, world = init_distributed()
model = DDP(mlp(), find_unused_parameters=True)  # expect: ddp-config
opt = torch.optim.SGD(model.parameters(), lr=0.01)
batches = Batches(loader_for(synthetic(), rank, world))


def step(i):
    x, y = batches.next()
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
