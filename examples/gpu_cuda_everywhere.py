"""A GPU trainer written the usual way: `.cuda()` on the model and on every batch, a NaN guard on the
loss, the loss logged with `.item()` and the accuracy brought back with `.cpu()` every step. On a
machine without a GPU, `audit run` rehearses it on the CPU and judges it as GPU code: the guard,
the logging and the copy back wait for the GPU each step, and the batches are copied to it from
pageable (unpinned) memory. Reading a host tensor (`lr_scale`) waits for nothing and is not reported."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
x = torch.randn(4096, 512)
y = (x[:, :16].sum(dim=1) > 0).long()
loader = DataLoader(TensorDataset(x, y), batch_size=512, shuffle=True, drop_last=True)  # expect: pageable-copy
model = nn.Sequential(nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
lr_scale = torch.tensor(1.0)  # a host tensor: reading it never waits for the GPU
batches = iter(loader)
history = []
accuracy = []


def next_batch():
    global batches
    try:
        return next(batches)
    except StopIteration:
        batches = iter(loader)
        return next(batches)


def step(i):
    x, y = next_batch()
    x, y = x.cuda(), y.cuda()  # expect: pageable-copy
    opt.zero_grad(set_to_none=True)
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    if torch.isnan(loss):  # expect: host-sync
        raise FloatingPointError(f"loss is NaN at step {i}")
    loss.backward()
    opt.step()
    history.append(loss.item())  # expect: host-sync
    accuracy.append((logits.argmax(1) == y).float().mean().cpu())  # expect: host-sync
    for group in opt.param_groups:
        group["lr"] = 0.05 * float(lr_scale)
