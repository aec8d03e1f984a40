"""Processes the program starts itself: what they run is not audited, and the summary says where
they were started (pytorch/examples mnist_hogwild trains in `mp.Process`es it starts, and its audit
measured only the evaluation loop of the process it started). A DataLoader's workers are not such
processes, nor are a library's own (a multiprocessing Pool's)."""
from __future__ import annotations

import pytest

from conftest import audit

PROGRAM = '''\
import multiprocessing

import torch
import torch.multiprocessing as tmp
from torch.utils.data import DataLoader, TensorDataset


def work(rank=0):
    torch.ones(2).sum()


def main():
    loader = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=8, num_workers=2)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # (a library's processes: not counted)
        pool.map(abs, [1])
    p = multiprocessing.get_context("spawn").Process(target=work)
    p.start()
    p.join()
    tmp.spawn(work, nprocs=2)
    for (x,) in loader:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    main()
'''


@pytest.mark.slow
def test_processes_the_program_starts_are_named_in_the_summary(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    a = audit("run", str(prog), "--steps", "8", "--no-profile", "--quiet", out=tmp_path / "out", cwd=tmp_path)
    assert a.returncode == 0, a.stderr[-3000:]
    starts = [t for t in a.evidence["setup"] if t["kind"] == "process-start"]
    lines = PROGRAM.splitlines()
    # its own Process (1, at its line) and torch.multiprocessing.spawn's 2 (at the user's spawn call)
    assert sorted((t["where"]["line"], t["count"], t["data"]["target"], t["data"]["method"]) for t in starts) == [
        (lines.index("    p.start()") + 1, 1, "work", "spawn"),
        (lines.index("    tmp.spawn(work, nprocs=2)") + 1, 2, "work", "spawn")]
    summary = (a.out / "summary.txt").read_text()
    assert ("processes: the program started 3 processes of its own (1 running `work` at prog.py:19, spawn; "
            "2 running `work` at prog.py:21, spawn): what they ran is not in this audit, which measures the "
            "process it started") in summary
    assert "where no optimizer stepped" not in summary  # (this process trained too)
    assert "processes:" in (a.out / "report.html").read_text()


@pytest.mark.slow
def test_a_program_whose_only_processes_are_its_dataloaders_workers_has_no_such_line(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM.replace("    p.start()\n    p.join()\n    tmp.spawn(work, nprocs=2)\n", "")
                    .replace("    p = multiprocessing.get_context(\"spawn\").Process(target=work)\n", ""))
    a = audit("run", str(prog), "--steps", "8", "--no-profile", "--quiet", out=tmp_path / "out", cwd=tmp_path)
    assert a.returncode == 0, a.stderr[-3000:]
    assert not [t for s in a.evidence["steps"] for t in s["tallies"] if t["kind"] == "process-start"]
    assert "processes:" not in (a.out / "summary.txt").read_text()
