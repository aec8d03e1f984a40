"""The README's demo: a GPU-style image classifier with four habits users report as "training is slow".

    audit run examples/demo.py:step --steps 30

It runs on a CPU-only machine too: the auditor rehearses it there, judging it as the GPU code it is.
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"


class Images(Dataset):
    """Stands in for decoding and augmenting images: real CPU work per sample."""

    def __len__(self):
        return 2048

    def __getitem__(self, idx):
        g = torch.Generator().manual_seed(idx)
        img = F.avg_pool2d(torch.rand(1, 3, 72, 72, generator=g), 3, stride=1, padding=1)[0]
        img = img[:, idx % 8:idx % 8 + 64, (idx // 8) % 8:(idx // 8) % 8 + 64]
        return (img - img.mean()) / (img.std() + 1e-6), idx % 10


loader = DataLoader(Images(), batch_size=64, shuffle=True)  # expect: dataloader-bound
model = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
batches = iter(loader)
epoch_loss = 0.0
log = []


def step(i):
    global batches, epoch_loss
    torch.cuda.reset_peak_memory_stats()  # expect: peak-stats-reset
    try:
        x, y = next(batches)
    except StopIteration:
        batches = iter(loader)
        x, y = next(batches)
    x, y = x.to(device), y.to(device)
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    epoch_loss += loss  # expect: graph-leak
    log.append({"step": i, "loss": loss.item(), "peak": torch.cuda.max_memory_allocated()})  # expect: host-sync
