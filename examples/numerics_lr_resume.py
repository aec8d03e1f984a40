"""Resuming with a changed config: the code asks for lr=1e-3 (make() builds AdamW with it), but
the optimizer state loaded from the previous run carries that run's lr of 3e-2, and
load_state_dict silently restores it: the whole run trains at 30x the configured rate."""
import io

import torch

from _common import Batches, make

loader, model, opt, loss_fn = make()
batches = Batches(loader)


def previous_run_checkpoint() -> bytes:
    """Stands in for last.ckpt of an earlier run that trained at lr=3e-2."""
    earlier = torch.optim.AdamW(model.parameters(), lr=3e-2)
    buf = io.BytesIO()
    torch.save({"optimizer": earlier.state_dict()}, buf)
    return buf.getvalue()


ckpt = torch.load(io.BytesIO(previous_run_checkpoint()), weights_only=True)
opt.load_state_dict(ckpt["optimizer"])  # expect: lr-schedule


def step(i):
    x, y = batches.next()
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
