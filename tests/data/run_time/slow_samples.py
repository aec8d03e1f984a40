"""A DataLoader whose workers keep up except on a few slow samples: `__getitem__` sleeps on one
index in 32 (a sample read from a slow disk), so the step that fetches its batch waits while the
others do not. Two workers, batches of 8: one batch in four holds a slow sample.

    python slow_samples.py [--steps N] [--stall-ms MS] [--record TRACE.json]

--record writes a torch.profiler trace of the loop (CPU, stacks, no schedule: no ProfilerSteps).
"""
import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Samples(Dataset):
    def __init__(self, n, stall_s):
        self.n, self.stall_s = n, stall_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i % 32 == 5:
            time.sleep(self.stall_s)  # (a sample read from a slow disk)
        g = torch.Generator().manual_seed(i)
        return torch.randn(64, generator=g), i % 4


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--stall-ms", type=float, default=120.0)
    ap.add_argument("--record", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    loader = DataLoader(Samples(4096, args.stall_ms / 1e3), batch_size=8, num_workers=2,
                        persistent_workers=True)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    prof = None
    if args.record:
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU], with_stack=True)
        prof.start()
    t0 = time.perf_counter()
    for k, (x, y) in enumerate(loader):
        if k == args.steps:
            break
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.004)  # the rest of a step's work
    print(f"wall {time.perf_counter() - t0:.3f} s for {args.steps} steps")
    if prof is not None:
        prof.stop()
        prof.export_chrome_trace(args.record)


if __name__ == "__main__":
    main()
