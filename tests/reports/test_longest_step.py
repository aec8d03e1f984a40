"""One step that took most of the run's time (a stall) is said in the summary, profiled or not: it
was mentioned nowhere (the median and the findings leave it out). A run of even steps says nothing."""
from __future__ import annotations

import re
from pathlib import Path

from conftest import audit

SCRIPT = '''import time

import torch

n = 0


def step():
    global n
    n += 1
    if n == {stall}:
        time.sleep(1.5)
    return torch.ones(2).sum()
'''


def test_a_stalled_step_is_said(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text(SCRIPT.format(stall=5))
    a = audit("run", f"{tmp_path / 't.py'}:step", "--steps", "8", "--no-numerics", out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    [line] = [ln for ln in a.stdout.splitlines() if ln.startswith("step 4 took ")]
    m = re.match(r"step 4 took (\d+\.\d\d) s, (\d+)% of all the steps' time \(the other steps' median: ", line)
    assert m and float(m.group(1)) >= 1.5 and int(m.group(2)) >= 90, line
    ms = {s["index"]: s["ms"] for s in a.evidence["steps"]}
    assert not {s["index"]: s["profiled"] for s in a.evidence["steps"]}[4]  # (after the window, steps 2-3)
    assert abs(float(m.group(1)) - ms[4] / 1000) <= 0.005


def test_even_steps_say_nothing(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text(SCRIPT.format(stall=-1))
    a = audit("run", f"{tmp_path / 't.py'}:step", "--steps", "8", "--no-numerics", out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    assert not [ln for ln in a.stdout.splitlines() if re.match(r"step \d+ took ", ln)]


PROGRAM = '''import time

import torch

w = torch.zeros(4, requires_grad=True)
opt = torch.optim.SGD([w], lr=0.1)
for i in range(10):
    (w * 2).sum().backward()
    opt.step()
    opt.zero_grad()
    if i == 8:
        time.sleep(1.5)
'''


def test_a_whole_programs_stall_outside_the_profiler_window_is_said(tmp_path: Path) -> None:
    """`audit run train.py` (steps found as it runs): the stall is a step after the profiler's
    window, timed by the step clock alone, and still named."""
    (tmp_path / "train.py").write_text(PROGRAM)
    a = audit("run", str(tmp_path / "train.py"), "--steps", "10", "--no-numerics", out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    steps = {s["index"]: s for s in a.evidence["steps"]}
    assert not steps[8]["profiled"] and any(s["profiled"] for s in steps.values())  # (outside the window)
    [line] = [ln for ln in a.stdout.splitlines() if ln.startswith("step 8 took ")]
    assert re.match(r"step 8 took \d+\.\d\d s, \d+% of all the steps' time \(the other steps' median: [\d.]+ ms\)$",
                    line), line
