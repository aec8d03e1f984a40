"""Shared setup for the example trainers: a seeded MLP classifier on synthetic data.

Each example imports this and adds the one habit its rule catches, so the rest of the step is
identical to the clean trainer's.
"""
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset


def make(seed: int = 0, width: int = 512, batch: int = 256, n: int = 8192):
    torch.manual_seed(seed)
    x = torch.randn(n, 128)
    y = (x[:, :16].sum(dim=1) > 0).long()
    data = TensorDataset(x, y)
    # the data sit in memory, so a batch is one index of each tensor: collating `batch` single rows
    # would cost ~2 ms a step, a fifth of it, and that is a real dataloader-bound finding
    order = RandomSampler(data, generator=torch.Generator().manual_seed(seed))
    loader = DataLoader(data, sampler=BatchSampler(order, batch_size=batch, drop_last=True), batch_size=None)
    model = nn.Sequential(nn.Linear(128, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return loader, model, opt, nn.CrossEntropyLoss()


class Batches:
    """Endless batches from a DataLoader, re-iterating at each epoch end."""

    def __init__(self, loader):
        self.loader = loader
        self.it = iter(loader)

    def next(self):
        try:
            return next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            return next(self.it)
