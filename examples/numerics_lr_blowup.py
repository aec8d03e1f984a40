"""Linear regression with plain SGD at a learning rate far above its stability limit (lr=4.0;
this problem is stable below about 0.3): each step overshoots the minimum by more than the last,
the gradient norm grows about tenfold per step, and around step 19 the squared error overflows
float32 to inf (the gradients and weights stay finite, and grow, for steps after that)."""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from _common import Batches

torch.manual_seed(0)
x = torch.randn(4096, 128)
w_true = torch.randn(128, 1) / 128 ** 0.5
y = x @ w_true + 0.1 * torch.randn(4096, 1)
loader = DataLoader(TensorDataset(x, y), batch_size=256, shuffle=True, drop_last=True,
                    generator=torch.Generator().manual_seed(0))
model = nn.Linear(128, 1)
opt = torch.optim.SGD(model.parameters(), lr=4.0)
batches = Batches(loader)


def step(i):
    x, y = batches.next()
    opt.zero_grad(set_to_none=True)
    loss = ((model(x) - y) ** 2).mean()  # expect: nonfinite
    loss.backward()
    opt.step()  # expect: grad-explosion
