"""nn.DataParallel in a training step: one process driving every GPU from threads, replicating the
model on each forward. DistributedDataParallel applies (the step trains) and is faster.
`audit run examples/ddp_data_parallel.py:step` (one process; no launcher needed) flags the wrap."""
import torch
import torch.nn.functional as F
from torch import nn

from ddp_common import mlp, synthetic

data = synthetic()
model = nn.DataParallel(mlp())  # expect: data-parallel
opt = torch.optim.SGD(model.parameters(), lr=0.01)


def step(i):
    lo = (i * 64) % (len(data) - 64)
    x, y = data[lo:lo + 64]
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
