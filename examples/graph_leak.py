"""A running loss kept as a tensor: every step's graph stays reachable from it."""
from _common import Batches, make

loader, model, opt, loss_fn = make()
batches = Batches(loader)
running_loss = 0.0


def step(i):
    global running_loss
    x, y = batches.next()
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    running_loss += loss  # expect: graph-leak
