"""A hand-written binary cross-entropy on sigmoid outputs: as training grows the logits, the
sigmoid of a confident positive rounds to exactly 1.0 in float32 (around logit 17), 1 - p
reaches 0 and log(0) = -inf; multiplied by its zero label that is NaN. With this learning rate
the loss is fine for the first ten steps and NaN from the step a logit crosses the line (11).
F.binary_cross_entropy_with_logits computes the same loss in log space and never does this."""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from _common import Batches

torch.manual_seed(0)
x = torch.randn(8192, 64)
y = (x[:, :8].sum(dim=1) > 0).float()
loader = DataLoader(TensorDataset(x, y), batch_size=256, shuffle=True, drop_last=True,
                    generator=torch.Generator().manual_seed(0))
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
opt = torch.optim.SGD(model.parameters(), lr=2.0)
batches = Batches(loader)


def step(i):
    x, y = batches.next()
    opt.zero_grad(set_to_none=True)
    p = torch.sigmoid(model(x).squeeze(1))
    pos = y * torch.log(p)
    neg = (1 - y) * torch.log(1 - p)  # expect: nonfinite
    loss = -(pos + neg).mean()
    loss.backward()
    opt.step()
