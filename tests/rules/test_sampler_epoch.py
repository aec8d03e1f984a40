"""sampler-epoch: a shuffling DistributedSampler iterated for a new epoch with an epoch value it
already used repeats its order. Real audits of small trainers whose step is one epoch; the sampler
is rank 0 of two (num_replicas/rank given: no process group)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import audit, patch_text

TRAINER = """
import os
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.manual_seed(0)
ds = TensorDataset(torch.randn(40, 8), torch.randn(40, 1))
dist_sampler = DistributedSampler(ds, num_replicas=2, rank=0)
loader = DataLoader(ds, batch_size=10, sampler=dist_sampler)
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
STEPS = int(os.environ.get("STEPS", "0"))


def step(epoch):
    for x, y in loader:
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    if epoch == STEPS - 1 and os.environ.get("WEIGHTS"):
        torch.save(model.state_dict(), os.environ["WEIGHTS"])
"""


def write(tmp_path):
    f = tmp_path / "train.py"
    f.write_text(TRAINER)
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
    # the patch sets the epoch before the loop; a new data order: marked as changing results
    assert [e["lines"] for e in finding["fix"]["edits"]] == [["    dist_sampler.set_epoch(epoch)"]]
    assert f"#   sampler-epoch train.py:{loop} [changes results: review it]" in patch_text(a.out / "fixes.patch")
    # the audit computed what a plain run computes
    plain = subprocess.run([sys.executable, "-c", "import train\nfor i in range(4): train.step(i)"], cwd=tmp_path,
                           env={"STEPS": "4", "WEIGHTS": str(tmp_path / "plain.pt"), "PATH": ""}, capture_output=True)
    assert plain.returncode == 0, plain.stderr
    audited, ref = torch.load(tmp_path / "audited.pt"), torch.load(tmp_path / "plain.pt")
    assert all(torch.equal(audited[k], ref[k]) for k in ref)
    subprocess.run(["git", "apply", str(a.out / "fixes.patch")], cwd=tmp_path, check=True)
    assert "    dist_sampler.set_epoch(epoch)\n    for x, y in loader:" in f.read_text()
    after = run(tmp_path, f, 4, "after")  # set_epoch with the changing step index: silent
    assert after.rule("sampler-epoch") == []


# Samplers each judged on its own (the rule groups iterations by sampler), in one program of 3
# epochs: each at its own lines (the line that made it, the loop that iterates it), so each test
# finds its sampler's finding there, or asserts that nothing is reported at its lines. Their
# loaders and orders do not touch one another; the step's shared model only consumes the batches.
SEVERAL = """
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.manual_seed(0)
ds = TensorDataset(torch.randn(40, 8), torch.randn(40, 1))


class EpochSampler(DistributedSampler):
    def __init__(self, ds):
        super().__init__(ds, num_replicas=2, rank=0)

    def __iter__(self):
        return super().__iter__()


constant_sampler = DistributedSampler(ds, num_replicas=2, rank=0)
constant_loader = DataLoader(ds, batch_size=10, sampler=constant_sampler)
inline_loader = DataLoader(ds, batch_size=10, sampler=DistributedSampler(ds, num_replicas=2, rank=0))
peeked_sampler = DistributedSampler(ds, num_replicas=2, rank=0)
peeked_loader = DataLoader(ds, batch_size=10, sampler=peeked_sampler)
first = next(iter(peeked_loader))
subclass_sampler = EpochSampler(ds)
subclass_loader = DataLoader(ds, batch_size=10, sampler=subclass_sampler)
first = next(iter(subclass_loader))
unshuffled_sampler = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=False)
unshuffled_loader = DataLoader(ds, batch_size=10, sampler=unshuffled_sampler)
once_sampler = DistributedSampler(ds, num_replicas=2, rank=0)
once_loader = DataLoader(ds, batch_size=10, sampler=once_sampler)
twice_sampler = DistributedSampler(ds, num_replicas=2, rank=0)
twice_loader = DataLoader(ds, batch_size=10, sampler=twice_sampler)
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)


def fit(x, y):
    loss = ((model(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def step(epoch):
    constant_sampler.set_epoch(3)
    for x, y in constant_loader:
        fit(x, y)
    for x, y in inline_loader:
        fit(x, y)
    peeked_sampler.set_epoch(epoch)
    for x, y in peeked_loader:
        fit(x, y)
    for x, y in subclass_loader:
        fit(x, y)
    for x, y in unshuffled_loader:
        fit(x, y)
    if epoch == 0:
        for x, y in once_loader:
            fit(x, y)
    twice_sampler.set_epoch(epoch)
    for x, y in twice_loader:
        fit(x, y)
    with torch.no_grad():
        total = sum(((model(x) - y) ** 2).mean() for x, y in twice_loader)
"""


@pytest.fixture(scope="module")
def several(tmp_path_factory):
    """SEVERAL audited for 3 epochs (one audit every test of it reads): (its file, the audit)."""
    tmp = tmp_path_factory.mktemp("several")
    f = tmp / "train.py"
    f.write_text(SEVERAL)
    return f, run(tmp, f, 3)


def at(a, f, *lines: int) -> list[dict]:
    """sampler-epoch's findings located at any of `lines` of `f`."""
    return [g for g in a.rule("sampler-epoch") if {(loc["file"], loc["line"]) for loc in g["locations"]}
            & {(str(f), n) for n in lines}]


def made_at(a, f, text: str) -> dict:
    """The one finding of the sampler made at the line holding `text` (its first location)."""
    line = line_of(f, text)
    [finding] = [g for g in a.rule("sampler-epoch") if (g["locations"][0]["file"], g["locations"][0]["line"])
                 == (str(f), line)]
    return finding


def test_set_epoch_with_a_constant_is_named(several):
    f, a = several
    finding = made_at(a, f, "constant_sampler = ")
    assert (finding["evidence"]["epochs_repeated"], finding["evidence"]["epoch_values"]) == (2, [3, 3, 3])
    assert "its epoch stayed 3" in finding["message"]
    assert finding["locations"][1]["line"] == line_of(f, "for x, y in constant_loader")


def test_an_unnamed_sampler_gets_the_summary_only(several):
    f, a = several
    finding = made_at(a, f, "inline_loader = DataLoader")
    assert [loc["line"] for loc in finding["locations"]] == [line_of(f, "inline_loader = DataLoader"),
                                                            line_of(f, "for x, y in inline_loader")]
    assert finding["evidence"]["epochs_repeated"] == 2
    assert finding["fix"]["edits"] == [] and "set_epoch(epoch)" in finding["fix"]["summary"]


def test_a_peek_at_a_batch_is_no_epoch_and_a_subclass_is_named_where_it_is_used(several):
    """`next(iter(loader))` at setup (to see a batch's shape) starts the sampler with epoch 0 and
    leaves it; the steps' epochs then start at 0 with set_epoch: no repeat. Without set_epoch the
    peek is not counted as an epoch either. A subclass's own __init__/__iter__ calling the base's
    are not the places named: the line that made it and the loop are."""
    f, a = several
    assert at(a, f, line_of(f, "peeked_sampler = "), line_of(f, "for x, y in peeked_loader")) == []
    peeked = [t for s in a.evidence["steps"] for t in s["tallies"]
              if t["kind"] == "sampler-iter" and t["data"]["made_line"] == line_of(f, "peeked_sampler = ")]
    assert [t["data"]["epoch"] for t in peeked] == [0, 1, 2]  # (the steps' epochs; the peek was at setup)
    finding = made_at(a, f, "subclass_sampler = EpochSampler(ds)")
    ev = finding["evidence"]
    assert (ev["epochs_started"], ev["epochs_repeated"], ev["iterations_left_early"]) == (3, 2, 1)
    assert "The shuffling EpochSampler made at" in finding["message"]
    assert [loc["line"] for loc in finding["locations"]] == [line_of(f, "subclass_sampler = EpochSampler(ds)"),
                                                            line_of(f, "for x, y in subclass_loader")]


def test_silent_without_shuffle_and_for_one_epoch(several):
    f, a = several
    assert at(a, f, line_of(f, "unshuffled_sampler = "), line_of(f, "for x, y in unshuffled_loader")) == []
    # the sampler's iterations were recorded all the same: the rule judged them
    starts = [t for s in a.evidence["steps"] for t in s["tallies"]
              if t["kind"] == "sampler-iter" and t["data"]["made_line"] == line_of(f, "unshuffled_sampler = ")]
    assert len(starts) == 3 and not starts[0]["data"]["shuffle"]
    # a shuffling sampler without set_epoch, iterated for one epoch only (the first step's)
    assert at(a, f, line_of(f, "once_sampler = "), line_of(f, "for x, y in once_loader")) == []
    once = [t for s in a.evidence["steps"] for t in s["tallies"]
            if t["kind"] == "sampler-iter" and t["data"]["made_line"] == line_of(f, "once_sampler = ")]
    assert len(once) == 1 and once[0]["data"]["shuffle"]


def test_a_loader_iterated_twice_per_epoch_with_set_epoch_is_silent(several):
    """set_epoch(epoch) each epoch, then an evaluation pass over the same loader: the epochs start
    with 0, 0, 1, 1, 2, 2; the shuffle changes from epoch to epoch, and nothing is wrong."""
    f, a = several
    starts = [t["data"]["epoch"] for s in a.evidence["steps"] for t in s["tallies"]
              if t["kind"] == "sampler-iter" and t["data"]["made_line"] == line_of(f, "twice_sampler = ")]
    assert starts == [0, 0, 1, 1, 2, 2]
    assert at(a, f, line_of(f, "twice_sampler = "), line_of(f, "for x, y in twice_loader"),
              line_of(f, "total = sum(")) == []


def test_only_the_samplers_that_repeat_are_named(several):
    """The program's findings are those of the three samplers that repeat an order, one each."""
    f, a = several
    made = sorted(g["locations"][0]["line"] for g in a.rule("sampler-epoch"))
    assert made == sorted(line_of(f, text) for text in ("constant_sampler = ", "inline_loader = DataLoader",
                                                        "subclass_sampler = EpochSampler(ds)"))


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
