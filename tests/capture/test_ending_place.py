"""A step that raises: the summary names where, as a plain run's traceback ends (it said only the
exception and its message)."""
from __future__ import annotations

from pathlib import Path

from conftest import audit

SCRIPT = '''import torch

n = 0


def step():
    global n
    n += 1
    if n == 2:
        raise ValueError("bad batch")
    return torch.ones(2).sum()
'''


def test_the_summary_says_where_the_step_raised(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text(SCRIPT)
    a = audit("run", f"{tmp_path / 't.py'}:step", "--steps", "3", "--no-profile", "--no-numerics",
              out=tmp_path / "out")
    assert a.returncode == 3, a.stderr
    lines = a.stdout.splitlines()
    at = lines.index("run ended: raised in step 1: ValueError: bad batch")  # (steps count from 0)
    assert lines[at + 1] == f'  at {tmp_path / "t.py"}:10: raise ValueError("bad batch")'
