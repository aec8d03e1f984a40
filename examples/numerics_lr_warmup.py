"""A linear warm-up written as a LambdaLR without a cap: the factor (s + 1) / 5 is meant to stop
at 1 after five steps, but keeps growing, so the learning rate passes the configured 1e-3 at
step 5 and is six times it by step 30."""
import torch

from _common import Batches, make

WARMUP = 5
loader, model, opt, loss_fn = make()
batches = Batches(loader)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / WARMUP)  # expect: lr-schedule


def step(i):
    x, y = batches.next()
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    sched.step()
