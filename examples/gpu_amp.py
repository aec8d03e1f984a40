"""A mixed-precision GPU trainer: float16 autocast with a GradScaler, pinned batches copied with
non_blocking=True -- and the loss logged with `.item()` every step, which waits for the GPU, as
does `scaler.step` with an optimizer that is not fused (it reads found_inf with `.item()`). On a
machine without a GPU, `audit run` rehearses it on the CPU: CPU autocast in float16 and a CPU
GradScaler do the same arithmetic."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

DEVICE = "cuda"
torch.manual_seed(0)
x = torch.randn(2048, 128)
y = (x[:, :8].sum(dim=1) > 0).long()
loader = DataLoader(TensorDataset(x, y), batch_size=256, shuffle=True, drop_last=True, pin_memory=True)
model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 10)).to(DEVICE)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler(DEVICE)
batches = iter(loader)
losses = []


def next_batch():
    global batches
    try:
        return next(batches)
    except StopIteration:
        batches = iter(loader)
        return next(batches)


def step(i):
    x, y = next_batch()
    x, y = x.to(DEVICE, non_blocking=True), y.to(DEVICE, non_blocking=True)
    opt.zero_grad(set_to_none=True)
    with torch.autocast(DEVICE, dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)  # expect: host-sync
    scaler.update()
    losses.append(loss.item())  # expect: host-sync
