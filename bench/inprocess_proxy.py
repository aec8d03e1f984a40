"""The issue's CPU proxy of a host-bound step (40 x (Linear + LayerNorm + GELU), AdamW, batch 16, one
thread) in this process, under the probes and collectors as the audited child installs them: what
bench_light_forward.py and bench_update_aside.py alternate their variants on, step by step."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FIRST_INDEX = 1001  # (odd, past the dense start: with steps of 2, never a checked step)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--blocks", type=int, default=40)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--width", type=int, default=32)


class Proxy:
    """The model and optimizer, the probes' Recorder (`rec`) and the installed collectors."""

    def __init__(self, layers: int, width: int) -> None:
        import torch
        from torch import nn

        from auditor.capture import probes
        from auditor.capture.collectors import load_collectors

        torch.set_num_threads(1)
        self.rec = probes.install()
        self.collectors = load_collectors()
        for c in self.collectors:
            c.install()
        torch.manual_seed(0)
        self.model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU())
                                     for _ in range(layers)])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(16, width)
        self.index = FIRST_INDEX

    def step(self) -> float:
        """One unchecked step, its boundaries told to the collectors; returns its update's CPU seconds."""
        self.index += 2
        for c in self.collectors:
            c.step_begin(self.index)
        loss = self.model(self.x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        u0 = time.process_time()
        self.opt.step()
        spent = time.process_time() - u0
        for c in self.collectors:
            c.step_end(self.index)
        return spent
