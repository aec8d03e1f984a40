"""Gradient accumulation over 4 micro-batches with retain_graph=True "to silence an error":
each micro-batch's graph and activations stay alive, though no backward uses them again."""
from _common import Batches, make

ACCUM = 4
loader, model, opt, loss_fn = make(batch=64)
batches = Batches(loader)


def step(i):
    opt.zero_grad(set_to_none=True)
    for _ in range(ACCUM):
        x, y = batches.next()
        loss = loss_fn(model(x), y) / ACCUM
        loss.backward(retain_graph=True)  # expect: retained-graph
    opt.step()
