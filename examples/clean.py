"""A clean trainer: `audit run examples/clean.py:step` reports nothing at warning level.
Batches come from an in-memory dataset, nothing is fetched from the device per step, nothing kept."""
from _common import Batches, make

loader, model, opt, loss_fn = make()
batches = Batches(loader)


def step(i):
    x, y = batches.next()
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
