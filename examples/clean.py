"""A clean CPU trainer: small MLP on synthetic data. `audit run examples/clean.py:step` stays quiet
at warning level: data is prepared once, no per-step syncs, no forced cleanup, nothing kept."""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
X = torch.randn(4096, 64)
Y = (X[:, :8].sum(dim=1) > 0).long()
loader = DataLoader(TensorDataset(X, Y), batch_size=128, shuffle=True, drop_last=True,
                    generator=torch.Generator().manual_seed(0))
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 2))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
loss_fn = nn.CrossEntropyLoss()
batches = iter(loader)


def next_batch():
    global batches
    try:
        return next(batches)
    except StopIteration:
        batches = iter(loader)
        return next(batches)


def step(i):
    x, y = next_batch()
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
