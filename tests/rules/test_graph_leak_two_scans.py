"""graph-leak judges growth over three scans: two say nothing of a trend (a window of the last
losses fills between the first two step boundaries, then stays), and a run of two steps reports
the rule as not judged, not a leak."""
from __future__ import annotations

from conftest import audit

# a clean loop that keeps the last two losses (with their graphs) for a smoothed loss it prints:
# one graph after step 0, two after step 1, two from then on
WINDOW = '''
from collections import deque
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
recent = deque(maxlen=2)

def step(i):
    opt.zero_grad()
    loss = model(torch.randn(16, 32)).pow(2).mean()
    loss.backward()
    opt.step()
    recent.append(loss)
'''


def _run(tmp_path, steps: int):
    path = tmp_path / "train.py"
    path.write_text(WINDOW)
    a = audit("run", f"{path}:step", "--steps", str(steps), "--quiet", "--no-profile", out=tmp_path / f"out{steps}")
    assert a.returncode == 0, a.stderr[-3000:]
    return a


def test_two_scans_that_grow_are_not_judged_and_a_third_shows_the_window_stays(tmp_path):
    two = _run(tmp_path, 2)
    nodes = [s["graph_nodes"] for s in two.evidence["graph_scans"]]
    assert len(nodes) == 2 and nodes[1] > nodes[0]  # the window filling: growth between two scans
    assert not two.rule("graph-leak")
    [why] = [s["reason"] for s in two.findings_doc["skipped_rules"] if s["rule"] == "graph-leak"]
    assert why.startswith(f"could not be judged from two graph scans: kept graphs grew from {nodes[0]} to {nodes[1]} ")
    # a longer run of the same loop: the window stays full, and there is no leak to report
    longer = _run(tmp_path, 8)
    assert [s["graph_nodes"] for s in longer.evidence["graph_scans"]] == [nodes[1]] * 3
    assert not longer.rule("graph-leak")
    assert not [s for s in longer.findings_doc["skipped_rules"] if s["rule"] == "graph-leak"]
