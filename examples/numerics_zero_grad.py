"""A regression target trained with cross_entropy, as pytorch/examples' DDP tutorial
(distributed/ddp-tutorial-series/single_gpu.py) trains nn.Linear(20, 1) on random (x, y) pairs:
the model's output has one column, so cross_entropy's log-softmax runs over a single class and is 0
whatever the input. The loss is 0 at every step, every gradient is exactly 0, and the optimizer's
updates change nothing: the run trains for as long as it is let and learns nothing."""
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

torch.manual_seed(0)
data = [(torch.rand(20), torch.rand(1)) for _ in range(2048)]
loader = DataLoader(data, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
model = torch.nn.Linear(20, 1)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
batches = iter(loader)


def step(i):
    global batches
    try:
        source, targets = next(batches)
    except StopIteration:
        batches = iter(loader)
        source, targets = next(batches)
    opt.zero_grad()
    output = model(source)
    loss = F.cross_entropy(output, targets)  # expect: zero-gradients
    loss.backward()
    opt.step()
