"""Forcing garbage collection and emptying the CUDA cache after every step "to avoid OOM"."""
import gc

import torch
from _common import Batches, make

loader, model, opt, loss_fn = make()
batches = Batches(loader)


def step(i):
    x, y = batches.next()
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    del loss
    gc.collect()  # expect: forced-cleanup
    torch.cuda.empty_cache()  # expect: forced-cleanup
