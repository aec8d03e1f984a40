"""A NaN that starts inside a named submodule: `encoder.norm` scales each sample to unit length
without an eps, and the dataset holds an all-zero padding row that first arrives in batch 14
(0 / 0 = NaN). The loss turns NaN there, and every weight after the first update."""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from _common import Batches

BATCH = 256
PAD_ROW = 14 * BATCH + 37  # a zero row, as left behind by padding variable-length records

torch.manual_seed(0)
x = torch.randn(8192, 128)
x[PAD_ROW] = 0.0
y = (x[:, :16].sum(dim=1) > 0).long()
loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False, drop_last=True)


class RowNorm(nn.Module):
    """Scale every sample to unit L2 norm."""

    def forward(self, x):
        return x / x.norm(dim=-1, keepdim=True)  # expect: nonfinite


class Encoder(nn.Module):
    def __init__(self, width: int = 512):
        super().__init__()
        self.norm = RowNorm()
        self.proj = nn.Linear(128, width)

    def forward(self, x):
        return torch.relu(self.proj(self.norm(x)))


class Classifier(nn.Module):
    def __init__(self, width: int = 512):
        super().__init__()
        self.encoder = Encoder(width)
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        return self.head(self.encoder(x))


model = Classifier()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
loss_fn = nn.CrossEntropyLoss()
batches = Batches(loader)


def step(i):
    x, y = batches.next()
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
