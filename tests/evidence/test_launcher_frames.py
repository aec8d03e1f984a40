"""A program started from a small launcher (runpy.run_path, the profiler stepped by an optimizer
hook, as the recorder of whole programs on the H100 did): each op's user frame is the
program's, not the launcher's hook that opened the ProfilerStep range."""
from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from auditor.evidence.trace.load import load_trace

PROGRAM = """\
import torch

model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
seen = []
for i in range(12):
    x = torch.randn(4, 8)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    seen.append(loss.item())
"""

LAUNCHER = """\
import runpy
import sys

from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile, schedule

out, target = sys.argv[1], sys.argv[2]


class Done(BaseException):
    pass


prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True,
               schedule=schedule(wait=5, warmup=1, active=3, repeat=1),
               on_trace_ready=lambda p: p.export_chrome_trace(out))
n = [0]


def hook(opt, args, kwargs):
    prof.step()
    n[0] += 1
    if n[0] >= 10:
        raise Done()


register_optimizer_step_post_hook(hook)
prof.start()
try:
    runpy.run_path(target, run_name="__main__")
except Done:
    pass
prof.stop()
"""


@pytest.mark.slow
def test_ops_of_a_launched_program_are_the_programs(tmp_path: Path) -> None:
    (tmp_path / "prog.py").write_text(PROGRAM)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    out = tmp_path / "t.pt.trace.json"
    subprocess.run([sys.executable, "launcher.py", str(out), "prog.py"], cwd=tmp_path, check=True,
                   capture_output=True, timeout=300)
    trace = load_trace(out)
    assert len(trace.steps) == 3
    where: Counter = Counter()
    for r in range(len(trace.col("name"))):
        if trace.name(r) in ("aten::item", "aten::addmm", "aten::mm"):
            f = trace.user_frame(r)
            where[(Path(f.file).name, f.function) if f else None] += 1
    # (the launcher's `def hook` line, whose prof.step() opened each step's range, named them all)
    assert set(where) == {("prog.py", "<module>")} and sum(where.values()) >= 9
