"""The batch's accuracy measured with a second forward outside torch.no_grad(): every step records
its autograd graph and keeps its activations for a backward pass that never comes."""
from _common import Batches, make

loader, model, opt, loss_fn = make()
batches = Batches(loader)


def step(i):
    x, y = batches.next()
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    accuracy = (model(x).argmax(-1) == y).float().mean()  # expect: unused-graph
    return accuracy
