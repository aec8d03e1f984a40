"""A GPU trainer that updates its weights by hand, one parameter at a time
(`p.data.add_(p.grad, alpha=-lr)` in a loop over the parameters): on a GPU each parameter costs its
own kernel launch, where torch.optim.SGD (foreach by default on CUDA, or fused=True) updates them all
in a few. On a machine without a GPU, `audit run` rehearses it on the CPU and counts the updates."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
x = torch.randn(2048, 64)
y = (x[:, :8].sum(dim=1) > 0).long()
loader = DataLoader(TensorDataset(x, y), batch_size=128, shuffle=True, drop_last=True, pin_memory=True)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2)).to(device)
lr = 0.05
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
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-lr)  # expect: manual-update
