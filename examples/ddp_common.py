"""Shared setup for the DDP example trainers: a process group from the launcher's environment
(env://, gloo so it runs on CPU), a seeded MLP and a DistributedSampler over synthetic data.

Run any of them as `audit run examples/ddp_<name>.py:step --nproc-per-node 2`, or under torchrun:
`torchrun --nproc-per-node 2 -m auditor run examples/ddp_<name>.py:step --out DIR`.
"""
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset


def init_distributed():
    """What a torchrun-launched script does first (env://); gloo because these examples run on CPUs.
    Started without a launcher, the script is a job of one rank (an in-memory store, no network)."""
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def synthetic(n: int = 4096, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 64, generator=g)
    y = (x[:, :8].sum(dim=1) > 0).long()
    return TensorDataset(x, y)


def loader_for(dataset: Dataset, rank: int, world: int, batch: int = 128, seed: int = 0) -> DataLoader:
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    return DataLoader(dataset, batch_size=batch, sampler=sampler, drop_last=True)


def mlp(seed: int = 0, width: int = 256) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


class Batches:
    """Endless batches, re-iterating (with a new sampler epoch) at each epoch end."""

    def __init__(self, loader: DataLoader):
        self.loader, self.epoch = loader, 0
        self.it = iter(loader)

    def next(self):
        try:
            return next(self.it)
        except StopIteration:
            self.epoch += 1
            self.loader.sampler.set_epoch(self.epoch)
            self.it = iter(self.loader)
            return next(self.it)


LOCAL_RANK = int(os.environ.get("LOCAL_RANK", 0))
