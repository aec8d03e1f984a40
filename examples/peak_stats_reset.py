"""A GPU-style trainer that logs peak memory by resetting the CUDA statistics every step.
Runs on a CPU-only machine: the auditor answers the torch.cuda calls as an idle device would."""
import torch
from _common import Batches, make

loader, model, opt, loss_fn = make()
batches = Batches(loader)
peaks = []


def step(i):
    torch.cuda.reset_peak_memory_stats()  # expect: peak-stats-reset
    x, y = batches.next()
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    peaks.append(torch.cuda.max_memory_allocated())
