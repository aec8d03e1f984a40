"""Two lines keep graphs in one holder: a running loss tensor in a dict, and the step's outputs
appended to a list in the same dict. Each keeps every step's graph alive."""
from _common import Batches, make

loader, model, opt, loss_fn = make()
batches = Batches(loader)
stats = {"loss": 0.0, "outputs": [], "steps": 0}


def step(i):
    x, y = batches.next()
    opt.zero_grad(set_to_none=True)
    out = model(x)
    loss = loss_fn(out, y)
    loss.backward()
    opt.step()
    stats["loss"] += loss  # expect: graph-leak
    stats["outputs"].append(out[:4])  # expect: graph-leak
    stats["steps"] += 1
