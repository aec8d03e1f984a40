"""Steps of a program that fetches one batch and trains on it for epochs (pytorch/examples
mnist_forward_forward: `x, y = next(iter(train_loader))`, then a thousand updates of each of its
layers, each layer with an Adam of its own): the fetch made the loader the training DataLoader,
whose next fetch never came, and the whole run was one step of 26.8 s ("Tensor.item x2000/step",
"x424/step"). One optimizer updating REPEATS_TO_SPLIT times in one step on backward passes of its
own ends that: each later update is a step. A critic's few updates per batch (a WGAN's five) stay
in the batch's step."""
from __future__ import annotations

import pytest

from conftest import ONE_THREAD, audit

from auditor.capture.steps import REPEATS_TO_SPLIT

pytestmark = pytest.mark.slow

UPDATES = 40
ONE_BATCH = f'''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(256, 16), torch.randint(0, 4, (256,))), batch_size=256)


class Layer(nn.Linear):
    def __init__(self, i, o):
        super().__init__(i, o)
        self.opt = torch.optim.Adam(self.parameters(), lr=0.01)

    def train_on(self, x):
        for i in range({UPDATES}):
            g = self.forward(x).relu().pow(2).mean(1)  # (its forward called directly, as the example does)
            loss = torch.log1p(torch.exp(2.0 - g)).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
        return self.forward(x).relu().detach()


x, y = next(iter(loader))
h = x
for layer in (Layer(16, 32), Layer(32, 32)):
    h = layer.train_on(h)
print("done")
'''

CRITIC = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(48, 8)), batch_size=8)
G, D = nn.Linear(4, 8), nn.Linear(8, 1)
opt_g, opt_d = torch.optim.Adam(G.parameters()), torch.optim.Adam(D.parameters())
for (real,) in loader:
    for _ in range(5):  # the critic's updates on one batch
        loss_d = D(G(torch.randn(8, 4)).detach()).mean() - D(real).mean()
        opt_d.zero_grad()
        loss_d.backward()
        opt_d.step()
    loss_g = -D(G(torch.randn(8, 4))).mean()
    opt_g.zero_grad()
    loss_g.backward()
    opt_g.step()
'''


def run(tmp_path, source: str):
    (tmp_path / "prog.py").write_text(source)
    a = audit("run", str(tmp_path / "prog.py"), "--steps", "200", "--to-end", "--no-profile", "--quiet",
              out=tmp_path / "out", env=ONE_THREAD)
    assert a.returncode == 0, a.stderr[-3000:]
    return a


def updates(step: dict) -> int:
    return sum(t["count"] for t in step["tallies"] if t["kind"] == "optimizer")


def test_a_batch_trained_on_for_epochs_is_stepped_by_its_updates(tmp_path):
    a = run(tmp_path, ONE_BATCH)
    split = REPEATS_TO_SPLIT + 1  # (the step that shows the boundary missed holds them)
    rest = UPDATES - split
    assert [updates(s) for s in a.evidence["steps"]] == ([split] + [1] * rest) * 2
    found = a.evidence["program"]["steps_found"]
    assert found.startswith("optimizer steps (Adam), 1 per iteration") and "DataLoader" not in found


def test_a_critics_updates_on_one_batch_stay_in_its_step(tmp_path):
    a = run(tmp_path, CRITIC)
    steps = a.evidence["steps"]
    assert len(steps) == 6  # one a batch
    assert [updates(s) for s in steps] == [6] * 6
    assert "each begins at a fetch of the training DataLoader" in a.evidence["program"]["steps_found"]
