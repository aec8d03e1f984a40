"""A DistributedSampler iterated for a new epoch without sampler.set_epoch(epoch): every epoch
shuffles into the same order. num_replicas/rank are given, so no process group is needed: this is
the sampler rank 0 of two would have. 200 samples, batch 25: 4 batches per rank per epoch."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.manual_seed(0)
x_all = torch.randn(200, 16)
y_all = x_all[:, :4].sum(1, keepdim=True)
dataset = TensorDataset(x_all, y_all)
sampler = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=True, seed=0)  # expect: sampler-epoch
loader = DataLoader(dataset, batch_size=25, sampler=sampler)
model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
epoch = 0
it = iter(loader)


def step(i):
    global it, epoch
    try:
        x, y = next(it)
    except StopIteration:
        epoch += 1
        it = iter(loader)
        x, y = next(it)  # expect: sampler-epoch
    loss = F.mse_loss(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
