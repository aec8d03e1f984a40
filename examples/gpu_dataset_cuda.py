"""A GPU trainer whose Dataset moves each sample to the GPU in `__getitem__`: one small copy per
sample, made inside DataLoader iteration, and batches collated on the device. On a machine without
a GPU, `audit run` rehearses it on the CPU and reports the copies at the `.cuda()` line."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Samples(Dataset):
    def __init__(self, n=2048):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 128, generator=g)
        self.y = (self.x[:, :8].sum(dim=1) > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i].cuda(), self.y[i].cuda()  # expect: dataloader-on-device


torch.manual_seed(0)
loader = DataLoader(Samples(), batch_size=128, shuffle=True, drop_last=True)  # expect: dataloader-on-device
model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
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
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
