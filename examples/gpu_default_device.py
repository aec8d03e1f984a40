"""A GPU trainer that makes CUDA the default device first thing, so the dataset is created on the
GPU and every batch the DataLoader collates is born there: the input pipeline runs on the training
stream and can never use worker processes. On a machine without a GPU, `audit run` rehearses it on
the CPU and reports where the batches come from."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.set_default_device("cuda")  # expect: dataloader-on-device
torch.manual_seed(0)
x = torch.randn(2048, 128)
y = (x[:, :8].sum(dim=1) > 0).long()
loader = DataLoader(TensorDataset(x, y), batch_size=256, drop_last=True)  # expect: dataloader-on-device
model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 10))
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
