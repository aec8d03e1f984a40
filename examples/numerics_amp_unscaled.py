"""float16 autocast with no GradScaler: the backward pass runs through float16 activations, where
gradients below ~6e-8 flush to zero, and nothing scales the loss to keep them representable.
(CPU autocast supports float16 too, so this runs anywhere.)"""
import torch

from _common import Batches, make

loader, model, opt, loss_fn = make(width=256, batch=128)
batches = Batches(loader)


def step(i):
    x, y = batches.next()
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):  # expect: amp-unscaled
        loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
