"""The middle graph scan of a long run reads the named holders only (graphs.ScanMemo): once the first
three full scans found every tensor with history inside a named holder, the scan between them and
the last counts what the names hold, and finds what a full scan finds there."""
from __future__ import annotations

import gc
import types

import pytest
import torch

from auditor.capture import graphs
from conftest import audit

PROGRAM = '''
import torch
from torch import nn

torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("seen", torch.zeros(8))

    def forward(self, x):
        y = self.lin(x)
        self.seen = self.seen + y.mean(0)  # BUFFER LINE
        return y


def watch():
    kept = []
    return lambda t: kept.append(t)  # CLOSURE LINE


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
keep = watch()
losses = []


def step(i):
    out = model(torch.randn(4, 8))
    loss = out.pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss)  # GLOBAL LINE
    keep(out)
    if i >= 20:  # from step 20 on, a graph kept under no name: a class's attribute
        Net.last = out.sum() * 2
'''


@pytest.mark.slow
def test_the_middle_scan_of_a_long_run_reads_the_named_holders_and_the_leak_is_found(tmp_path):
    """A 52-step audit scans after steps 1, 4, 16, 26 and 51; the scan after 26 reads the names only.
    It counts each holder's tensors as the full scans do (a global list, a module's buffer, a
    closure's variable, which only the full scans' pass over every object finds), and graph-leak
    names all three at their lines. The tensor the program keeps from step 20 on under no name (a
    class attribute) is counted by the last scan, a full one, and not by the middle one: that scan
    read the names only."""
    path = tmp_path / "prog.py"
    path.write_text(PROGRAM)
    a = audit("run", f"{path}:step", "--steps", "52", "--quiet", "--no-profile", "--no-numerics", out=tmp_path / "out",
              env={"OMP_NUM_THREADS": "1"})
    assert a.returncode == 0, a.stderr[-2000:]
    scans = a.evidence["graph_scans"]
    assert [s["after_step"] for s in scans] == [1, 4, 16, 26, 51]
    for s in scans:  # after step s: s + 1 losses, s + 1 outputs in the closure's list, one buffer
        assert {h["name"]: h["graph_tensors"] for h in s["holders"]} == {
            "model.seen": 1, "losses": s["after_step"] + 1, "kept": s["after_step"] + 1}, s
    assert [s["tensors"] for s in scans] == [5, 11, 35, 2 * 27 + 1, 2 * 52 + 1 + 1]
    lines = {text.split("# ")[1]: n for n, text in enumerate(PROGRAM.splitlines(), 1) if " LINE" in text}
    [leak] = a.rule("graph-leak")
    assert leak["evidence"]["compared_steps"] == [1, 26, 51]
    assert {h["name"] for h in leak["evidence"]["holders"]} == {"model.seen", "losses", "kept"}, leak["message"]
    assert {loc["line"] for loc in leak["locations"]} == set(lines.values()), leak["locations"]


def test_a_graph_outside_every_name_keeps_the_scans_full():
    """A full scan that meets a tensor with history that no holder reaches (here a class's
    attribute) keeps every later scan full: it counts that tensor, as the first scans did."""
    module = types.ModuleType("prog")
    w = torch.ones(3, requires_grad=True)
    module.kept = [(w * 2).sum()]

    class Cache:
        pass

    Cache.last = (w * 3).sum()  # under no name the scan reads
    gc.collect()
    memo = graphs.ScanMemo()
    full = [graphs.scan(module, None, memo=memo) for _ in range(graphs.ScanMemo.FULL)]
    assert memo.full == graphs.ScanMemo.FULL and memo.unnamed and not memo.named_only()
    later = graphs.scan(module, None, memo=memo, named_only=True)
    assert memo.full == graphs.ScanMemo.FULL + 1  # (it walked every object)
    assert later["tensors"] == full[-1]["tensors"] >= 2
    assert [h["name"] for h in later["holders"] if h["graph_tensors"]] == ["kept"]


def test_the_named_scan_counts_what_a_full_scan_counts_under_the_names():
    """With every tensor with history under a name (a global, a closure's variable), the scan after
    three full ones reads the names only (the memo's count of full scans stays) and gives the same
    record as a full scan of the same state."""
    module = types.ModuleType("prog")
    w = torch.ones(3, requires_grad=True)
    module.losses = []

    def watch():
        seen = []
        return lambda t: seen.append(t)

    module.keep = watch()
    gc.collect()
    # (what earlier tests in this process left alive with history is put under a name too)
    module.earlier = [o for o in gc.get_objects() if type(o) in (torch.Tensor, torch.nn.Parameter)
                      and o.grad_fn is not None]
    memo = graphs.ScanMemo()
    for i in range(graphs.ScanMemo.FULL):
        module.losses.append((w * i).sum())
        module.keep(w * 2)
        graphs.scan(module, None, memo=memo)
    assert memo.named_only()
    module.losses.append((w * 5).sum())
    module.keep(w * 7)
    named = graphs.scan(module, None, memo=memo, named_only=True)
    assert memo.full == graphs.ScanMemo.FULL  # (it read the names only)
    assert named == graphs.scan(module, None)
    assert {h["name"]: h["graph_tensors"] for h in named["holders"] if h["graph_tensors"] and h["name"] != "earlier"} \
        == {"losses": 4, "seen": 4}
    assert named["tensors"] == 8 + len(module.earlier)


def test_a_view_held_under_a_name_names_its_base():
    """A global that holds a view of a result with history (PPO's `newvalue = critic(x).view(-1)`,
    a `gather(...).squeeze(-1)`) keeps the view's base alive, a tensor with history that no name
    holds itself: it counts as held, so the scans after three full ones read the names only, and
    count the base as a full scan does."""
    module = types.ModuleType("prog")
    w = torch.ones(4, 1, requires_grad=True)
    gc.collect()
    module.earlier = [o for o in gc.get_objects() if type(o) in (torch.Tensor, torch.nn.Parameter)
                      and o.grad_fn is not None]
    memo = graphs.ScanMemo()
    for i in range(graphs.ScanMemo.FULL):
        module.newvalue = (w * i).view(-1)
        module.logprob = w.gather(0, torch.full((1, 1), i % 4)).squeeze(-1)
        full = graphs.scan(module, None, memo=memo)
    assert not memo.unnamed and memo.named_only()
    named = graphs.scan(module, None, memo=memo, named_only=True)
    assert memo.full == graphs.ScanMemo.FULL  # (it read the names only)
    assert named["tensors"] == full["tensors"] == 4 + len(module.earlier)  # (two views, two bases)
