"""Running accuracy over every sample seen so far, recomputed each step: the evaluation grows
with the run, so each step is slower than the last."""
import torch
from _common import Batches, make

loader, model, opt, loss_fn = make()
batches = Batches(loader)
seen_x = torch.empty(0, 128)
seen_y = torch.empty(0, dtype=torch.long)


def step(i):
    global seen_x, seen_y
    x, y = batches.next()
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    seen_x, seen_y = torch.cat([seen_x, x]), torch.cat([seen_y, y])
    with torch.no_grad():
        train_acc = (model(seen_x).argmax(1) == seen_y).float().mean()  # expect: step-slowdown
    return train_acc
