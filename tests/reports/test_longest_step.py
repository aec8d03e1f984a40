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
    assert abs(float(m.group(1)) - ms[4] / 1000) <= 0.005


def test_even_steps_say_nothing(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text(SCRIPT.format(stall=-1))
    a = audit("run", f"{tmp_path / 't.py'}:step", "--steps", "8", "--no-numerics", out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    assert not [ln for ln in a.stdout.splitlines() if re.match(r"step \d+ took ", ln)]
