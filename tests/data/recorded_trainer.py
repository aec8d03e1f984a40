"""One small CPU trainer recorded with torch.profiler in the ways users record, for the tests that
read real traces (tests/conftest.py's `recording` fixture runs it once per session, as train.py).

It writes, in its working directory:
- in_function.json, tb/w.*.pt.trace.json, called.json, module.json: a DataLoader-bound loop profiled
  (with_stack=True) from inside main(), with a schedule (scheduled()), around a called train(), and
  at module level. test_trace_startup_frames.py asserts their lines: main()'s profiler line is the
  first line of this file that opens a profiler; the module-level one is the only unindented one;
- eight.json, two.json: 8 and 2 optimizer steps recorded without a schedule (no ProfilerSteps);
- gan_loader.json, gan.json, accumulate.json, logs.json: two Adams an iteration (with and without a
  DataLoader), an optimizer step every 2nd batch, and more work every other iteration
  (test_trace_no_schedule.py);
- steps.json: 4 ProfilerSteps under a schedule, no memory events (test_recording_page.py).
"""
import sys, time
import torch
torch.set_num_threads(1)  # (two cores shared with other jobs: spinning threads make 2x2 ops take 15 ms)
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)


class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(0.003)
        return torch.ones(4), i % 2


loader = torch.utils.data.DataLoader(Slow(), batch_size=2)


def main():
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        for i, (x, y) in enumerate(loader):
            model(x).sum().backward()
            if i == 3:
                break
    prof.export_chrome_trace("in_function.json")


def scheduled():
    sched = schedule(wait=0, warmup=1, active=3, repeat=1)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True, schedule=sched,
                 on_trace_ready=tensorboard_trace_handler("tb", worker_name="w")) as prof:
        for i, (x, y) in enumerate(loader):
            model(x).sum().backward()
            prof.step()
            if i == 5:
                break


def train(n):
    for i, (x, y) in enumerate(loader):
        model(x).sum().backward()
        if i == n:
            break


def clean():
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        train(3)
    prof.export_chrome_trace("called.json")


def record(iterations, out):
    loader = torch.utils.data.DataLoader(Slow(), batch_size=2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i, (x, y) in enumerate(loader):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if i + 1 == iterations:
                break
    prof.export_chrome_trace(out)


# Loops that step several optimizers an iteration, or one every few iterations.
torch.manual_seed(0)
G = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
D = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt_g = torch.optim.Adam(G.parameters(), lr=1e-3)
opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)  # (same class, same parameter count as G's)
bce = torch.nn.functional.binary_cross_entropy_with_logits
real_data = torch.utils.data.TensorDataset(torch.randn(256, 4))


def gan_step(real):
    fake = G(torch.randn(real.shape[0], 8))
    ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
    d_loss = bce(D(real), ones) + bce(D(fake.detach()), zeros)
    opt_d.zero_grad(); d_loss.backward(); opt_d.step()
    g_loss = bce(D(fake), ones)
    opt_g.zero_grad(); g_loss.backward(); opt_g.step()


def gan(out, loader):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        if loader:
            for i, (real,) in enumerate(torch.utils.data.DataLoader(real_data, batch_size=8)):
                gan_step(real)
                if i == 7:
                    break
        else:
            for i in range(8):
                gan_step(torch.randn(8, 4))
    prof.export_chrome_trace(out)


def accumulate(out):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(256, 4), torch.randint(0, 2, (256,)))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i, (x, y) in enumerate(torch.utils.data.DataLoader(data, batch_size=8)):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if i % 2 == 1:  # an optimizer step every 2nd batch
                opt.step()
                opt.zero_grad()
            if i == 11:
                break
    prof.export_chrome_trace(out)


def logs_every_other(out):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(10):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 2, (8,)))
            loss.backward()
            opt.step()
            if i % 2 == 0:  # more work every other iteration: not a second optimizer
                print(round(loss.item(), 3), torch.randn(3).sum().item(), file=sys.stderr)
    prof.export_chrome_trace(out)


def profiler_steps(out):
    """Six iterations under a schedule (1 warmup, 4 active): 4 ProfilerSteps, no memory events."""
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=4, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(out)) as prof:
        for _ in range(6):
            opt.zero_grad()
            model(torch.randn(32, 16)).sum().backward()
            opt.step()
            prof.step()


main()
scheduled()
clean()
record(8, "eight.json")
record(2, "two.json")
gan("gan_loader.json", loader=True)
gan("gan.json", loader=False)
accumulate("accumulate.json")
logs_every_other("logs.json")
profiler_steps("steps.json")
with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
    for i, (x, y) in enumerate(loader):
        model(x).sum().backward()
        if i == 3:
            break
prof.export_chrome_trace("module.json")
