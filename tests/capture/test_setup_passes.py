"""Forward passes a program runs before its loop (pytorch/examples fast_neural_style: its style
image's features through VGG, once, after making its DataLoader): they are its setup, not a step.
Step 0 held that forward and nothing else, and the summary read "0.9 per iteration" with per-step
counts averaged over it (conv2d x5.75/step for 6)."""
from __future__ import annotations

import pytest

from conftest import ONE_THREAD, audit

pytestmark = pytest.mark.slow

STYLE_FIRST = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(48, 8), torch.randn(48, 1)), batch_size=8)
features = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
with torch.no_grad():
    style = features(torch.randn(1, 8)).mean()  # SETUP LINE
    model(torch.randn(2, 8))  # a sanity check of the model's output shape
for x, y in loader:
    opt.zero_grad()
    loss = (model(x) - y).pow(2).mean() + 0 * style
    loss.backward()
    opt.step()
'''

NEVER_FETCHED = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
test_loader = DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=8)  # made, used after training
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for i in range(6):
    opt.zero_grad()
    loss = model(torch.randn(8, 8)).pow(2).mean()
    loss.backward()
    opt.step()
'''

NO_OPTIMIZER = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

loader = DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=8)  # made, never iterated
model = nn.Linear(8, 1)
with torch.no_grad():
    for i in range(4):
        model(torch.randn(8, 8))
'''


def run(tmp_path, source: str):
    (tmp_path / "prog.py").write_text(source)
    a = audit("run", str(tmp_path / "prog.py"), "--steps", "50", "--to-end", "--no-profile", "--quiet",
              out=tmp_path / "out", env=ONE_THREAD)
    assert a.returncode == 0, a.stderr[-3000:]
    return a


def count(step: dict, kind: str) -> int:
    return sum(t["count"] for t in step["tallies"] if t["kind"] == kind)


def test_a_forward_before_the_first_fetch_is_setup(tmp_path):
    a = run(tmp_path, STYLE_FIRST)
    steps = a.evidence["steps"]
    assert len(steps) == 6  # one a batch
    assert [count(s, "optimizer") for s in steps] == [1] * 6
    assert [count(s, "forward") for s in steps] == [1] * 6
    assert a.evidence["program"]["steps_found"].startswith(
        "optimizer steps (SGD), 1 per iteration; each begins at a fetch of the training DataLoader")
    setup_forwards = [t for t in a.evidence["setup"] if t["kind"] == "forward"]
    assert sum(t["count"] for t in setup_forwards) == 2
    line = next(n for n, text in enumerate(STYLE_FIRST.splitlines(), 1) if "SETUP LINE" in text)
    assert line in {t["where"]["line"] for t in setup_forwards}


def test_a_loop_that_never_fetches_is_stepped_by_its_updates(tmp_path):
    a = run(tmp_path, NEVER_FETCHED)
    steps = a.evidence["steps"]
    assert [count(s, "optimizer") for s in steps] == [1] * 6
    # (the first iteration's forward and backward were taken for setup until its update showed a
    # loop that never fetches: they are in step 0)
    assert [count(s, "forward") for s in steps] == [1] * 6
    assert [count(s, "backward") for s in steps] == [1] * 6
    assert not [t for t in a.evidence["setup"] if t["kind"] in ("forward", "backward")]
    assert a.evidence["program"]["steps_found"].startswith("optimizer steps (SGD), 1 per iteration")


def test_a_program_that_makes_no_optimizer_keeps_its_work_as_one_step(tmp_path):
    """(an inference script: nothing marks its iterations, and its work from its first pass is one
    step, as in any program without optimizer, fetch or marker)"""
    a = run(tmp_path, NO_OPTIMIZER)
    [step] = a.evidence["steps"]
    assert count(step, "forward") == 4
    assert a.evidence["program"]["steps_found"].startswith("no optimizer step")
