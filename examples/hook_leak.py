"""Clipping every gradient with a hook on its parameter, registered inside the step: each step adds
one more hook to every parameter, none is removed, and every backward pass runs all of them."""
from _common import Batches, make

loader, model, opt, loss_fn = make()
batches = Batches(loader)


def step(i):
    for p in model.parameters():
        p.register_hook(lambda g: g.clamp(-1.0, 1.0))  # expect: hook-leak
    x, y = batches.next()
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
