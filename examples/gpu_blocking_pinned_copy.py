"""A GPU trainer that pins its batches (DataLoader(pin_memory=True)) and then copies them with a
plain `.to(device)`: the copy blocks the host until it is done, so the pinning buys no overlap of
the copy with the previous step's kernels. `non_blocking=True` is what pinned memory is for. On a
machine without a GPU, `audit run` rehearses it on the CPU and counts the copies."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
x = torch.randn(4096, 1024)
y = torch.randint(0, 10, (4096,))
data = TensorDataset(x, y)
# the data sit in memory: index a whole batch at once rather than collating 512 single rows
loader = DataLoader(data, sampler=BatchSampler(RandomSampler(data), batch_size=512, drop_last=True), batch_size=None,
                    pin_memory=True)
model = nn.Sequential(nn.Linear(1024, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
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
    x = x.to(device)  # expect: blocking-pinned-copy
    y = y.to(device, non_blocking=True)
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
