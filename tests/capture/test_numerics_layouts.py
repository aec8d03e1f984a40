"""Tensors torch cannot reduce, made in an audited step: a float8 cast (aminmax has no float8
kernel), a nested tensor and an MKL-DNN one. The numerics checks leave them alone (they measure
the tensors they were made from) and the program runs as it does plainly: before, each raised
NotImplementedError or RuntimeError into the program from the checks."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import ONE_THREAD, audit

from auditor.capture.numerics.tensors import _checkable

pytestmark = pytest.mark.slow

PROGRAM = '''import json, sys
import torch
from torch import nn

torch.manual_seed(0)
lin = nn.Linear(8, 8)
opt = torch.optim.SGD(lin.parameters(), lr=0.1)
x = torch.randn(16, 8)


def step(i):
    opt.zero_grad()
    h = lin(x)
    cached = h.detach().to(torch.float8_e4m3fn).float()  # a float8 copy, as a quantised cache keeps one
    rows = torch.nested.nested_tensor([h[:3].detach(), h[3:].detach()])
    spread = sum(t.abs().sum() for t in rows.unbind())
    dense = h.detach().to_mkldnn().to_dense()
    loss = (h - 0.01 * cached - 0.01 * dense).pow(2).mean() + 0 * spread
    loss.backward()
    opt.step()
    if i == STEPS - 1:
        json.dump(lin.weight.tolist(), open(sys.argv[1], "w"))


STEPS = 6
if __name__ == "__main__":
    for i in range(STEPS):
        step(i)
'''


def test_tensors_torch_cannot_reduce_are_not_checked():
    assert not _checkable(torch.randn(4).to(torch.float8_e4m3fn))
    assert not _checkable(torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]))
    assert not _checkable(torch.randn(4, 4).to_mkldnn())
    assert _checkable(torch.randn(4)) and _checkable(torch.randn(4, 4).to_sparse())


def test_a_step_that_makes_them_runs_as_it_does_plainly(tmp_path):
    import subprocess
    import sys

    (tmp_path / "prog.py").write_text(PROGRAM)
    subprocess.run([sys.executable, str(tmp_path / "prog.py"), str(tmp_path / "plain.json")], check=True,
                   env={**ONE_THREAD, "PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    a = audit("run", f"{tmp_path / 'prog.py'}:step", "--steps", "6", "--no-profile", "--quiet",
              "--", str(tmp_path / "audited.json"), out=tmp_path / "out", env=ONE_THREAD)
    assert a.returncode == 0, a.stderr[-3000:]
    assert a.evidence["ending"]["status"] == "completed", a.evidence["ending"]
    checked = [s for s in a.evidence["steps"] if s.get("numerics") is not None]
    assert len(checked) == 6  # (a 6-step audit is checked throughout)
    assert json.loads((tmp_path / "audited.json").read_text()) == json.loads((tmp_path / "plain.json").read_text())
