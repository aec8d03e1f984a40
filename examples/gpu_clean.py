"""A clean GPU trainer: `audit run` rehearses it on a machine without a GPU and reports nothing at
warning level. Batches are indexed from memory a batch at a time, pinned and copied with
non_blocking=True, the loss is summed on the device and read every 10 steps, nothing synchronises
the device in a normal step."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.backends.cudnn.benchmark = True
torch.manual_seed(0)
x = torch.randn(2048, 128)
y = (x[:, :8].sum(dim=1) > 0).long()
data = TensorDataset(x, y)
# the data sit in memory: index a whole batch at once rather than collating 256 single rows
loader = DataLoader(data, sampler=BatchSampler(RandomSampler(data), batch_size=256, drop_last=True), batch_size=None,
                    pin_memory=True)
model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
batches = iter(loader)
running = torch.zeros((), device=device)
log = []


def next_batch():
    global batches
    try:
        return next(batches)
    except StopIteration:
        batches = iter(loader)
        return next(batches)


def step(i):
    global running
    x, y = next_batch()
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    running += loss.detach()
    if (i + 1) % 10 == 0:
        log.append(running.item() / 10)
        running.zero_()
