"""Anomaly detection switched on at import "just in case" and never switched off."""
import torch
from _common import Batches, make

torch.autograd.set_detect_anomaly(True)  # expect: anomaly-mode
loader, model, opt, loss_fn = make()
batches = Batches(loader)


def step(i):
    x, y = batches.next()
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
