"""What reading the CUDA allocator's bytes costs at each step boundary of a GPU run.

    python bench/bench_device_memory.py [--calls 20000] [--gpu]

Every step's record carries the allocator's allocated and reserved bytes at its end
(auditor.capture.session.device_memory). torch.cuda.memory_allocated() and memory_reserved() each
read the allocator's ~120 stats as a nested dict (torch._C._cuda_memoryStats, one C call), then
flatten and sort all of them in Python (torch.cuda.memory_stats) to return one number.
device_memory() reads the nested dict once and takes both numbers from it.

Runs anywhere: the C call is replaced by a function returning a dict of the same shape (the one
tests/capture/test_step_memory.py checks both readings against), so what is timed is the Python
around it, which is the same on a GPU machine; the C call itself (torch's way makes it twice, the
one read once) is not; `--gpu` times both on this machine's CUDA allocator, the C call included.
Printed: the median of `--calls` calls of each way, hot (back to back); at a step boundary, after a
step's work, both are slower.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "capture"))
from auditor.capture import session  # noqa: E402
from test_step_memory import nested_stats  # noqa: E402


def timed(f, calls: int) -> float:
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--gpu", action="store_true",
                    help="time both ways on this machine's CUDA allocator (a GPU machine), the C call included")
    args = ap.parse_args()
    if args.gpu:
        held = [torch.empty(n << 20, dtype=torch.uint8, device="cuda") for n in (1, 3, 7)]  # (a few blocks)
        assert session.device_memory() == (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
        before = timed(lambda: (torch.cuda.memory_allocated(), torch.cuda.memory_reserved()), args.calls)
        now = timed(session.device_memory, args.calls)
        print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {len(held)} blocks held:")
        print(f"torch.cuda.memory_allocated() + memory_reserved(): {before:6.1f} us (median of {args.calls})")
        print(f"session.device_memory() (one nested read):         {now:6.1f} us: {before - now:.1f} us less a step")
        return
    stats = nested_stats()
    torch._C._cuda_memoryStats = lambda device: stats
    torch.cuda.is_initialized = lambda: True
    torch.cuda.is_available = lambda: True
    torch.cuda.memory.is_initialized = lambda: True
    torch.cuda.memory._get_device_index = lambda device, optional=False: 0
    assert session.device_memory() == (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
    before = timed(lambda: (torch.cuda.memory_allocated(), torch.cuda.memory_reserved()), args.calls)
    now = timed(session.device_memory, args.calls)
    print(f"torch.cuda.memory_allocated() + memory_reserved(): {before:6.1f} us (median of {args.calls})")
    print(f"session.device_memory() (one nested read):         {now:6.1f} us: {before - now:.1f} us less a step")


if __name__ == "__main__":
    main()
