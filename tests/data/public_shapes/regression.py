"""pytorch/examples `regression/main.py` as it is (a Linear layer fit to a degree-4 polynomial, its
update written by hand, the loss fetched with `.item()` for the stop criterion), with a cap on the
batches so that a plain run ends as fast as the audit's. The target's bias is fetched with
`b_target.item()` in `f`, whose `return` gives a tensor: the number is computed with, not needed
at once."""
from __future__ import print_function
from itertools import count

import torch
import torch.nn.functional as F

torch.manual_seed(0)
POLY_DEGREE = 4
W_target = torch.randn(POLY_DEGREE, 1) * 5
b_target = torch.randn(1) * 5


def make_features(x):
    """Builds features i.e. a matrix with columns [x, x^2, x^3, x^4]."""
    x = x.unsqueeze(1)
    return torch.cat([x ** i for i in range(1, POLY_DEGREE+1)], 1)


def f(x):
    """Approximated function."""
    return x.mm(W_target) + b_target.item()


def get_batch(batch_size=32):
    """Builds a batch i.e. (x, f(x)) pair."""
    random = torch.randn(batch_size)
    x = make_features(random)
    y = f(x)
    return x, y


# Define model
fc = torch.nn.Linear(W_target.size(0), 1)

for batch_idx in count(1):
    # Get data
    batch_x, batch_y = get_batch()

    # Reset gradients
    fc.zero_grad()

    # Forward pass
    output = F.smooth_l1_loss(fc(batch_x), batch_y)
    loss = output.item()

    # Backward pass
    output.backward()

    # Apply gradients
    for param in fc.parameters():
        param.data.add_(-0.1 * param.grad)

    # Stop criterion
    if loss < 1e-3 or batch_idx == 40:
        break

print('Loss: {:.6f} after {} batches'.format(loss, batch_idx))
