"""sampler-epoch: a shuffling DistributedSampler iterated for a new epoch with an epoch value it
already used repeats its order. Real audits of small trainers whose step is one epoch; the sampler
is rank 0 of two (num_replicas/rank given: no process group)."""
from __future__ import annotations

import subprocess
import sys

import torch

from conftest import audit, patch_text

TRAINER = """
import os
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.manual_seed(0)
ds = TensorDataset(torch.randn(40, 8), torch.randn(40, 1))
{sampler}
{peek}
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
STEPS = int(os.environ.get("STEPS", "0"))


def step(epoch):
    {set_epoch}
    for x, y in loader:
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    if epoch == STEPS - 1 and os.environ.get("WEIGHTS"):
        torch.save(model.state_dict(), os.environ["WEIGHTS"])
"""
NAMED = ("dist_sampler = DistributedSampler(ds, num_replicas=2, rank=0, shuffle={shuffle})\n"
         "loader = DataLoader(ds, batch_size=10, sampler=dist_sampler)")
INLINE = "loader = DataLoader(ds, batch_size=10, sampler=DistributedSampler(ds, num_replicas=2, rank=0))"


def write(tmp_path, sampler=NAMED.format(shuffle=True), set_epoch="pass", peek=""):
    f = tmp_path / "train.py"
    f.write_text(TRAINER.format(sampler=sampler, set_epoch=set_epoch, peek=peek))
    return f


def line_of(f, text):
    return next(i for i, line in enumerate(f.read_text().splitlines(), 1) if text in line)


def run(tmp_path, f, steps, name="out", env=None):
    a = audit("run", f"{f.name}:step", "--steps", str(steps), "--no-profile", "--quiet", out=tmp_path / name,
              cwd=tmp_path, env={"STEPS": str(steps), **(env or {})})
    assert a.returncode == 0, a.stderr
    return a


def test_epochs_without_set_epoch_are_named_and_the_patch_fixes_them(tmp_path):
    f = write(tmp_path)
    a = run(tmp_path, f, 4, env={"WEIGHTS": str(tmp_path / "audited.pt")})
    [finding] = a.rule("sampler-epoch")
    made, loop = line_of(f, "dist_sampler = "), line_of(f, "for x, y in loader")
    assert [(loc["file"], loc["line"]) for loc in finding["locations"]] == [(str(f), made), (str(f), loop)]
    assert finding["severity"] == "warning"
    ev = finding["evidence"]
    assert (ev["epochs_started"], ev["epochs_repeated"], ev["epoch_values"]) == (4, 3, [0, 0, 0, 0])
    assert f"DistributedSampler made at train.py:{made} started 4 epochs and 3 of them repeated" in finding["message"]
    assert "its epoch stayed 0" in finding["message"] and f"from train.py:{loop}" in finding["message"]
    # the patch sets the epoch before the loop; a new data order: numerics-fixes.patch, not fixes.patch
    assert [e["lines"] for e in finding["fix"]["edits"]] == [["    dist_sampler.set_epoch(epoch)"]]
    assert "set_epoch" not in patch_text(a.out / "fixes.patch")
    # the audit computed what a plain run computes
    plain = subprocess.run([sys.executable, "-c", "import train\nfor i in range(4): train.step(i)"], cwd=tmp_path,
                           env={"STEPS": "4", "WEIGHTS": str(tmp_path / "plain.pt"), "PATH": ""}, capture_output=True)
    assert plain.returncode == 0, plain.stderr
    audited, ref = torch.load(tmp_path / "audited.pt"), torch.load(tmp_path / "plain.pt")
    assert all(torch.equal(audited[k], ref[k]) for k in ref)
    subprocess.run(["git", "apply", str(a.out / "numerics-fixes.patch")], cwd=tmp_path, check=True)
    assert "    dist_sampler.set_epoch(epoch)\n    for x, y in loader:" in f.read_text()
    after = run(tmp_path, f, 4, "after")  # set_epoch with the changing step index: silent
    assert after.rule("sampler-epoch") == []


def test_set_epoch_with_a_constant_is_named(tmp_path):
    f = write(tmp_path, set_epoch="dist_sampler.set_epoch(3)")
    [finding] = run(tmp_path, f, 3).rule("sampler-epoch")
    assert (finding["evidence"]["epochs_repeated"], finding["evidence"]["epoch_values"]) == (2, [3, 3, 3])
    assert "its epoch stayed 3" in finding["message"]


def test_an_unnamed_sampler_gets_the_summary_only(tmp_path):
    f = write(tmp_path, sampler=INLINE)
    [finding] = run(tmp_path, f, 2).rule("sampler-epoch")
    assert finding["locations"][0]["line"] == line_of(f, "loader = DataLoader")
    assert finding["evidence"]["epochs_repeated"] == 1
    assert finding["fix"]["edits"] == [] and "set_epoch(epoch)" in finding["fix"]["summary"]


SUBCLASS = """
class EpochSampler(DistributedSampler):
    def __init__(self, ds):
        super().__init__(ds, num_replicas=2, rank=0)

    def __iter__(self):
        return super().__iter__()


dist_sampler = EpochSampler(ds)
loader = DataLoader(ds, batch_size=10, sampler=dist_sampler)"""


def test_a_peek_at_a_batch_is_no_epoch_and_a_subclass_is_named_where_it_is_used(tmp_path):
    """`next(iter(loader))` at setup (to see a batch's shape) starts the sampler with epoch 0 and
    leaves it; the steps' epochs then start at 0 with set_epoch: no repeat. Without set_epoch the
    peek is not counted as an epoch either. A subclass's own __init__/__iter__ calling the base's
    are not the places named: the line that made it and the loop are."""
    peek = "first = next(iter(loader))"
    f = write(tmp_path, set_epoch="dist_sampler.set_epoch(epoch)", peek=peek)
    a = run(tmp_path, f, 3, "peek-ok")
    assert a.rule("sampler-epoch") == []
    f = write(tmp_path, sampler=SUBCLASS, peek=peek)
    [finding] = run(tmp_path, f, 3, "peek-bug").rule("sampler-epoch")
    ev = finding["evidence"]
    assert (ev["epochs_started"], ev["epochs_repeated"], ev["iterations_left_early"]) == (3, 2, 1)
    assert "The shuffling EpochSampler made at" in finding["message"]
    assert [loc["line"] for loc in finding["locations"]] == [line_of(f, "dist_sampler = EpochSampler(ds)"),
                                                            line_of(f, "for x, y in loader")]


def test_silent_without_shuffle_and_for_one_epoch(tmp_path):
    f = write(tmp_path, sampler=NAMED.format(shuffle=False))
    a = run(tmp_path, f, 3, "noshuffle")
    assert a.rule("sampler-epoch") == []
    # the sampler's iterations were recorded all the same: the rule judged them
    starts = [t for s in a.evidence["steps"] for t in s["tallies"] if t["kind"] == "sampler-iter"]
    assert len(starts) == 3 and not starts[0]["data"]["shuffle"]
    f = write(tmp_path)
    assert run(tmp_path, f, 1, "one").rule("sampler-epoch") == []


DDP = """
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
device = "cuda"
torch.manual_seed(0)
ds = TensorDataset(torch.randn(40, 8), torch.randn(40, 1))
sampler = DistributedSampler(ds, shuffle=True)
loader = DataLoader(ds, batch_size=10, sampler=sampler)
model = DDP(nn.Linear(8, 1).to(device))
opt = torch.optim.SGD(model.parameters(), lr=0.1)


def step(i):
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
"""


def test_a_rehearsed_ddp_job_is_named_once_and_says_it_rehearses_once(tmp_path):
    """Two ranks under the launcher, each rehearsing CUDA on the CPU: one finding in the merged
    report, each rank's epochs recorded; the rehearsal line is printed by rank 0 alone (it was
    printed once per rank)."""
    f = tmp_path / "ddp_train.py"
    f.write_text(DDP)
    a = audit("run", f"{f.name}:step", "--steps", "3", "--no-profile", "--quiet", "--nproc-per-node", "2",
              out=tmp_path / "out", cwd=tmp_path)
    assert a.returncode == 0, a.stderr
    assert a.stderr.count("audit: no CUDA device here: rehearsing this CUDA program") == 1, a.stderr
    [finding] = a.rule("sampler-epoch")
    assert finding["locations"][0]["line"] == line_of(f, "sampler = DistributedSampler")
    assert (finding["evidence"]["epochs_started"], finding["evidence"]["epochs_repeated"]) == (3, 2)
    for rank in (0, 1):
        ev = (tmp_path / "out" / f"rank-{rank}" / "evidence.json").read_text()
        assert ev.count('"kind":"sampler-iter"') == 3


def test_a_loader_iterated_twice_per_epoch_with_set_epoch_is_silent(tmp_path):
    """set_epoch(epoch) each epoch, then an evaluation pass over the same loader: the epochs start
    with 0, 0, 1, 1, 2, 2; the shuffle changes from epoch to epoch, and nothing is wrong."""
    f = write(tmp_path, set_epoch="dist_sampler.set_epoch(epoch)")
    f.write_text(f.read_text().replace("    if epoch == STEPS - 1", "    with torch.no_grad():\n"
                                       "        total = sum(((model(x) - y) ** 2).mean() for x, y in loader)\n"
                                       "    if epoch == STEPS - 1"))
    a = run(tmp_path, f, 3)
    starts = [t["data"]["epoch"] for s in a.evidence["steps"] for t in s["tallies"] if t["kind"] == "sampler-iter"]
    assert starts == [0, 0, 1, 1, 2, 2]
    assert a.rule("sampler-epoch") == []
