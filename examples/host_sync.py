"""Logging with .item() every step and counting correct predictions on the host: on a GPU each of
these waits for every queued kernel."""
from _common import Batches, make

loader, model, opt, loss_fn = make()
batches = Batches(loader)
history = []
correct = 0


def step(i):
    global correct
    x, y = batches.next()
    opt.zero_grad(set_to_none=True)
    logits = model(x)
    loss = loss_fn(logits, y)
    loss.backward()
    opt.step()
    history.append(loss.item())  # expect: host-sync
    correct += int((logits.argmax(1) == y).sum())  # expect: host-sync
