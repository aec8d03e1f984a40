"""A GPU trainer that logs peak memory by resetting the CUDA memory statistics every step (host time; a
reset does not synchronise the device). Its batches are pinned and copied with non_blocking=True, as
they should be. On a machine without a GPU, `audit run` rehearses it on the CPU."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

device = torch.device("cuda")
torch.manual_seed(0)
x = torch.randn(2048, 128)
y = (x[:, :8].sum(dim=1) > 0).long()
loader = DataLoader(TensorDataset(x, y), batch_size=256, shuffle=True, drop_last=True, pin_memory=True)
model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
batches = iter(loader)
peaks = []


def next_batch():
    global batches
    try:
        return next(batches)
    except StopIteration:
        batches = iter(loader)
        return next(batches)


def step(i):
    torch.cuda.reset_peak_memory_stats()  # expect: peak-stats-reset
    x, y = next_batch()
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    peaks.append(torch.cuda.max_memory_allocated())
