"""manual-update's code patch (auditor/rules/_support/update_edits.py): each hand-written update loop
it rewrites computes, as one torch._foreach_* call, the weights the loop computes (bit for bit, on
real parameters and gradients), and the loops it cannot rewrite that way get no patch."""
from __future__ import annotations

import textwrap

import pytest
import torch

from auditor.rules._support.update_edits import foreach_update

REWRITTEN = {
    "add alpha, .data": "for p in model.parameters():\n    p.data.add_(p.grad, alpha=-lr)",
    "sub, no alpha": "for p in model.parameters():\n    p.data.sub_(p.grad.data)",
    "-= lr * grad": "for p in model.parameters():\n    p -= lr * p.grad  # plain SGD",
    "-= grad * lr, one line": "for q in model.parameters(): q.data -= q.grad * lr",
}
LEFT = {
    "reads its parameter": "for p in model.parameters():\n    p -= lr * p.grad * p",
    "momentum, two statements": "for p in model.parameters():\n    buf.mul_(0.9)\n    p.data.add_(p.grad, alpha=-lr)",
    "named_parameters": "for n, p in model.named_parameters():\n    p.data.add_(p.grad, alpha=-lr)",
    "a call in alpha": "for p in model.parameters():\n    p.data.add_(p.grad, alpha=-next_lr())",
    "not a parameters() loop": "for p in params:\n    p.data.add_(p.grad, alpha=-lr)",
    "not the gradient": "for p in model.parameters():\n    p.data.add_(p.data, alpha=-lr)",
}


def _program(loop: str) -> str:
    return "import torch\n\n\ndef update(model, lr, buf=None, params=(), next_lr=None):\n" + textwrap.indent(loop, "    ") + "\n"


def _trained(text: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    model(torch.randn(4, 5)).pow(2).mean().backward()
    scope: dict = {}
    exec(compile(text, "prog.py", "exec"), scope)
    with torch.no_grad():
        scope["update"](model, 0.37)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", sorted(REWRITTEN))
def test_a_rewritten_loop_trains_the_same_weights(tmp_path, name):
    src = tmp_path / "prog.py"
    text = _program(REWRITTEN[name])
    src.write_text(text)
    body = len(text.splitlines())  # (the loop's body: the file's last line)
    edit = foreach_update(str(src), body)
    assert edit is not None and len(edit.lines) == 1 and "_foreach_" in edit.lines[0], edit
    assert edit.end == body and edit.start == (body if "one line" in name else body - 1)
    lines = text.splitlines()
    patched = "\n".join(lines[:edit.start - 1] + edit.lines + lines[edit.end:]) + "\n"
    assert not any(ln.strip().startswith("for ") for ln in patched.splitlines())
    if "#" in REWRITTEN[name]:
        assert edit.lines[0].endswith("# plain SGD")
    before, after = _trained(text), _trained(patched)
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    assert not all(torch.equal(x, y) for x, y in zip(before, _trained(_program("pass"))))  # (it did update)


@pytest.mark.parametrize("name", sorted(LEFT))
def test_a_loop_one_foreach_call_would_not_compute_the_same_gets_no_patch(tmp_path, name):
    src = tmp_path / "prog.py"
    text = _program(LEFT[name])
    src.write_text(text)
    assert foreach_update(str(src), len(text.splitlines())) is None
