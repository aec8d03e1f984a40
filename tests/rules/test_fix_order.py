"""Fixes in the order they can be applied: a Dataset that makes CUDA tensors in `__getitem__` and
is slow to make them. dataloader-bound's fix (DataLoader workers) works only once the data is built
on the CPU (CUDA does not run in a forked worker: the H200 run of such a trainer failed with
"AcceleratorError in DataLoader worker process 0" under its fix alone), so its finding says so and
names the fix to apply first, which --verify applies before it or, with no edit to apply, does not
verify it alone. The same program with the Dataset on the CPU: no such order."""
from __future__ import annotations

import pytest

from auditor.findings import Finding, Fix

PROGRAM = '''import time

import torch
from torch.utils.data import DataLoader, Dataset


class Slow(Dataset):
    def __len__(self):
        return 4096

    def __getitem__(self, i):
        time.sleep(0.002)
        return torch.ones(16){place} * i, torch.tensor(i % 2){place}


loader = DataLoader(Slow(), batch_size=16)
model = torch.nn.Linear(16, 2).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
batches = iter(loader)


def step(i):
    x, y = next(batches)
    loss = torch.nn.functional.cross_entropy(model(x.cuda()), y.cuda())
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


@pytest.mark.parametrize("place", [".cuda()", ""])
def test_workers_after_the_data_leaves_the_device(tmp_path, place) -> None:
    from conftest import audit

    (tmp_path / "prog.py").write_text(PROGRAM.format(place=place))
    a = audit("run", f"{tmp_path / 'prog.py'}:step", "--steps", "8", "--no-profile", "--no-numerics",
              out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    rules = {f["rule"]: f for f in a.findings}
    slow = rules["dataloader-bound"]
    if place:
        assert "dataloader-on-device" in rules
        assert slow["evidence"]["apply_after"] == ["dataloader-on-device"]
        assert "Apply its fix after dataloader-on-device's: its Dataset makes CUDA tensors" in slow["message"]
    else:
        assert "dataloader-on-device" not in rules and "apply_after" not in slow["evidence"]
        assert "Apply its fix after" not in slow["message"]


def test_verify_applies_the_fix_it_depends_on_first() -> None:
    from auditor.findings import Edit
    from auditor.reports.patch import prerequisites

    first = Finding(rule="dataloader-on-device", severity="warning", title="", message="",
                    fix=Fix(summary="", edits=[Edit(file="prog.py", start=13, end=13, lines=["x"])]))
    later = Finding(rule="dataloader-bound", severity="warning", title="", message="",
                    evidence={"apply_after": ["dataloader-on-device"]}, fix=Fix(summary=""))
    assert prerequisites(later, [later, first]) == [first]
    assert prerequisites(first, [later, first]) == []
    bare = Finding(rule="dataloader-on-device", severity="warning", title="", message="", fix=Fix(summary=""))
    assert prerequisites(later, [later, bare]) == []  # (no edit to apply first: verify leaves it unverified)
