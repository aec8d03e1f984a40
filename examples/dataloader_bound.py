"""Per-sample decoding and augmentation in __getitem__, loaded in the main process (num_workers=0):
the model waits for every batch."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from _common import Batches

torch.manual_seed(0)


class SyntheticImages(Dataset):
    """Stands in for JPEG decoding + augmentation: a few ms of CPU work per batch."""

    def __len__(self):
        return 4096

    def __getitem__(self, idx):
        g = torch.Generator().manual_seed(idx)
        img = torch.rand(3, 72, 72, generator=g)
        img = F.avg_pool2d(img.unsqueeze(0), 3, stride=1, padding=1).squeeze(0)  # "decode"
        top, left = int(idx % 8), int((idx // 8) % 8)
        img = img[:, top:top + 64, left:left + 64]  # random crop
        img = (img - img.mean()) / (img.std() + 1e-6)  # normalise
        return img, idx % 10


loader = DataLoader(SyntheticImages(), batch_size=64, shuffle=True,  # expect: dataloader-bound
                    generator=torch.Generator().manual_seed(0))
model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                      nn.Linear(128, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
batches = Batches(loader)


def step(i):
    x, y = batches.next()
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
