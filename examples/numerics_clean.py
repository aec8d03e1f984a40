"""The clean twin of the numerics examples: float16 autocast with a GradScaler, gradient clipping
and a warm-up that stops at the configured learning rate. nonfinite, grad-explosion, lr-schedule
and amp-unscaled stay silent."""
import torch

from _common import Batches, make

WARMUP = 5
loader, model, opt, loss_fn = make(width=256, batch=128)
batches = Batches(loader)
scaler = torch.amp.GradScaler("cpu")
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))


def step(i):
    x, y = batches.next()
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    scaler.step(opt)
    scaler.update()
    sched.step()
