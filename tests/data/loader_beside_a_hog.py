"""A DataLoader with num_workers=0 whose dataset spends 0.5 ms of CPU an item (4 ms a batch), in a
process that shares its one CPU with a busy process it starts itself: each fetch takes about twice
its CPU time on the wall clock, half of it waiting for the CPU the other process holds."""
import atexit
import os
import subprocess
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

STEPS = 12  # (the test audits this many; after the last, the process has its CPUs back)
CPUS = os.sched_getaffinity(0)
CPU = min(CPUS)
os.sched_setaffinity(0, {CPU})
hog = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{CPU}}})\nwhile True: pass"])
atexit.register(hog.kill)
time.sleep(0.2)  # (the busy process pinned and running)


class Burn(Dataset):
    def __len__(self):
        return 100_000

    def __getitem__(self, i):
        t = time.thread_time()
        while time.thread_time() - t < 0.0005:
            pass
        return torch.full((4,), float(i % 7))


loader = DataLoader(Burn(), batch_size=8)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
batches = iter(loader)


def step(i):
    x = next(batches)
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    if i == STEPS - 1:
        hog.kill()
        os.sched_setaffinity(0, CPUS)
