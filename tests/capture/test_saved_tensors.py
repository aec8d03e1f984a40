"""The audit reads the tensors a graph saved without unpacking them: under activation checkpointing
(its saved-tensor hooks), unpacking reruns the program's forward, inside the audit. A checkpointed
trainer that backpropagates with retain_graph=True ran its blocks' forward 112 times audited against
72 plain, and 16 more at the run's end (graph-leak's scan of the held loss)."""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from auditor.capture import saved_tensors
from conftest import ONE_THREAD, audit

PROGRAM = '''import atexit
import sys
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

torch.manual_seed(0)
CALLS = [0]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        CALLS[0] += 1
        return torch.relu(self.lin(x))


blocks = nn.ModuleList(Block() for _ in range(3))
head = nn.Linear(64, 1)
opt = torch.optim.SGD([*blocks.parameters(), *head.parameters()], lr=0.01)
atexit.register(lambda: open(sys.argv[1], "w").write(str(CALLS[0])))
for step in range(12):
    h = torch.randn(32, 64)
    for b in blocks:
        h = {call}
    loss = head(h).pow(2).mean()
    opt.zero_grad()
    loss.backward(retain_graph=True)  # RETAIN LINE
    opt.step()
'''
CHECKPOINTED = PROGRAM.format(call="checkpoint(b, h, use_reentrant=False)")
PLAIN = PROGRAM.format(call="b(h)")


def test_a_checkpointed_graphs_saved_values_are_not_unpacked(monkeypatch):
    monkeypatch.setattr(saved_tensors._Hooks, "entered", saved_tensors._Hooks.entered)  # (put back after)
    if not saved_tensors.PACKED_FORM:  # (as the audit does: torch 2.4 reads nothing once hooks were entered)
        hooks = torch.autograd.graph.saved_tensors_hooks
        monkeypatch.setattr(hooks, "__enter__", saved_tensors.noting_entered(hooks.__enter__))
    calls = [0]

    def block(x):
        calls[0] += 1
        return torch.cat([x.sin(), x.cos()]).exp()

    x = torch.randn(3, requires_grad=True)
    y = block(x)
    got = saved_tensors.saved_of(y.grad_fn)  # (exp saves its result)
    assert got.complete and len(got.tensors) == 1 and got.tensors[0].equal(y.detach())
    c = checkpoint(block, x, use_reentrant=False)
    assert saved_tensors.saved_of(c.grad_fn) == ([], False)  # (checkpointing's holder: not read)
    if not saved_tensors.PACKED_FORM:  # torch 2.4: no saved value is read once hooks were entered
        assert saved_tensors.saved_of(y.grad_fn) == ([], False)
    with torch.autograd.graph.save_on_cpu():
        w = (x * x).sin()
    assert saved_tensors.saved_of(w.grad_fn).complete is False  # (a (device, CPU copy) pair: not read)
    assert calls[0] == 2  # the forward ran twice, as the program ran it: no recomputation
    y.sum().backward()
    assert saved_tensors.saved_of(y.grad_fn).tensors == []  # (freed by the backward)


@pytest.mark.slow
@pytest.mark.parametrize("text,partial,calls", [(CHECKPOINTED, True, 72), (PLAIN, False, 36)],
                         ids=["checkpointed", "plain"])
def test_a_retained_graphs_reading_runs_no_forward_again(tmp_path, text, partial, calls):
    prog = tmp_path / "prog.py"
    prog.write_text(text)
    a = audit("run", str(prog), "--steps", "12", "--no-profile", "-q", "--", str(tmp_path / "calls"),
              out=tmp_path / "out", env=ONE_THREAD)
    assert a.returncode == 0, a.stderr[-2000:]
    # as a plain run: 12 steps x 3 blocks (x 2 checkpointed: the backward's own recomputation)
    assert (tmp_path / "calls").read_text() == str(calls)
    line = next(n for n, t in enumerate(text.splitlines(), 1) if "# RETAIN LINE" in t)
    (f,) = a.rule("retained-graph")
    assert f["locations"][0]["line"] == line
    ev = f["evidence"]
    assert ev["retained_unused"] == 12 and ev["saved_bytes_partial"] is partial
    if partial and not saved_tensors.PACKED_FORM:  # (torch 2.4: nothing read once hooks were entered)
        assert ev["saved_bytes"] == 0
    elif partial:
        # the head's input (32x64 fp32) and output are read; the blocks' saved values, packed by the
        # checkpoint's hooks, are not: a lower bound, said as one
        assert 8192 <= ev["saved_bytes"] < 3 * 8192, ev
        assert "at least 0.01 MiB of saved tensors each; values packed by saved-tensor hooks" in f["message"]
    else:  # each block's input and output, and the head's: all read
        assert ev["saved_bytes"] >= 6 * 8192, ev
        assert "at least" not in f["message"]
