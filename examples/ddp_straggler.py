"""One slow rank: rank 1 reads its shard from slower storage (each sample takes ~0.8 ms longer to
fetch), so in every step rank 0 finishes its backward and then waits in DDP's gradient all-reduce
for rank 1. `audit run examples/ddp_straggler.py:step --nproc-per-node 2` names rank 1, the data
loading phase, and the time rank 0 waits."""
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

from ddp_common import init_distributed, loader_for, mlp, synthetic

rank, world = init_distributed()


class ShardOnSlowDisk(Dataset):
    """Stands in for a shard on a slower disk or a remote bucket: the read waits, the CPU idles."""

    def __init__(self, data, read_s: float):
        self.data, self.read_s = data, read_s

    def __len__(self):
        return len(self.data)

    def __getitem__(self, idx):
        if self.read_s:
            time.sleep(self.read_s)
        return self.data[idx]


def endless(loader):
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        epoch += 1
        yield from loader  # expect: rank-straggler


loader = loader_for(ShardOnSlowDisk(synthetic(), read_s=0.0008 if rank == 1 else 0.0), rank, world)
batches = endless(loader)
model = DDP(mlp())
opt = torch.optim.SGD(model.parameters(), lr=0.01)


def step(i):
    x, y = next(batches)
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
