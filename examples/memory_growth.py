"""Keeping every step's logits (detached) for an end-of-epoch metric: 2.5 MiB more each step."""
from _common import Batches, make

loader, model, opt, loss_fn = make(width=2560)
batches = Batches(loader)
all_logits = []


def step(i):
    x, y = batches.next()
    opt.zero_grad(set_to_none=True)
    hidden = model[:-1](x)
    logits = model[-1](hidden)
    loss = loss_fn(logits, y)
    loss.backward()
    opt.step()
    all_logits.append(hidden.detach())  # expect: memory-growth
