"""unused-graph: forwards made with grad enabled whose graphs no backward pass uses (a learner
choosing its action, an evaluation loop, outside torch.no_grad()), found by watching the graphs of
real runs, at their lines; silent where the same program runs them
under torch.no_grad(), and on the training forward whose graph is backpropagated (CleanRL's dqn.py
chose each action with `q_network(obs)` under grad: 204 graphs, none used)."""
from __future__ import annotations

import pytest

from conftest import ONE_THREAD, audit

PROGRAM = '''import torch
from torch import nn

torch.manual_seed(0)
policy = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4))
opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
valid = [torch.randn(256, 8) for _ in range(4)]


def act(obs):
    {act}logits = policy(obs)  # ACT LINE
    return torch.argmax(logits, dim=-1)


for epoch in range(3):
    for it in range(10):
        obs = torch.randn(16, 8)
        for k in range(4):
            act(obs[k:k + 1])
        loss = policy(obs).logsumexp(-1).mean()  # TRAIN LINE
        opt.zero_grad()
        loss.backward()
        opt.step()
    {eval}outs = [policy(v) for v in valid]  # EVAL LINE
    print(epoch, round(sum(float(o.mean()) for o in outs), 4))
'''
GRAD = PROGRAM.format(act="", eval="")
NO_GRAD = PROGRAM.format(act="with torch.no_grad():\n        ", eval="with torch.no_grad():\n        ")


def _line(text: str, mark: str) -> int:
    return next(n for n, t in enumerate(text.splitlines(), 1) if f"# {mark} LINE" in t)


def _run(tmp_path, text: str):
    (tmp_path / "prog.py").write_text(text)
    a = audit("run", str(tmp_path / "prog.py"), "--steps", "40", "--no-profile", "-q", out=tmp_path / "out",
              env=ONE_THREAD)
    assert a.returncode == 0, a.stderr[-2000:]
    return a


@pytest.mark.slow
def test_forwards_whose_graphs_no_backward_uses_are_named_at_their_lines(tmp_path):
    a = _run(tmp_path, GRAD)
    found = {f["locations"][0]["line"]: f for f in a.rule("unused-graph")}
    act, train, evaluate = (_line(GRAD, m) for m in ("ACT", "TRAIN", "EVAL"))
    assert set(found) == {act, evaluate}, found  # (the training forward's graphs are backpropagated)
    # the action's forward: 4 a step, every graph watched in the checked steps freed unused as act returns
    ev = found[act]["evidence"]
    assert ev["graphs_used"] == 0 and ev["graphs_unused"] >= 4 * 20 and ev["calls_per_step"] == 4
    # the evaluation after each epoch: its graphs are freed when the next epoch's list replaces them
    # (the last epoch's still held at the end: no verdict). A
    # forward under grad after an update begins the next step to the step finder (steps 10 and 20):
    # only the last epoch's, after the last step, is outside the steps
    ev = found[evaluate]["evidence"]
    assert ev["graphs_used"] == 0 and ev["graphs_unused"] == 8, ev
    assert (ev["calls_in_steps"], ev["calls_outside_steps"], ev["calls_per_step"]) == (8, 4, 0), ev
    assert "(8 call(s) in 2 of the 30 steps, 4 outside the steps" in found[evaluate]["message"]
    # the fix: the statement inside `with torch.no_grad():`, as NO_GRAD has it
    [edit] = found[act]["fix"]["edits"]
    assert (edit["start"], edit["end"]) == (act, act)
    assert edit["lines"] == ["    with torch.no_grad():", "        logits = policy(obs)  # ACT LINE"]
    assert found[act]["cost"]["ms_per_step"] is None and "counted, not timed" in found[act]["cost"]["note"]


@pytest.mark.slow
def test_the_same_forwards_under_no_grad_are_silent(tmp_path):
    a = _run(tmp_path, NO_GRAD)
    assert a.rule("unused-graph") == []
    # (the graphs were watched: the training forward's, each used)
    seen = {(t["what"], t["where"]["line"]) for s in a.evidence["steps"] for t in s["tallies"] if t["kind"] == "graph-use"}
    assert seen == {("used", _line(NO_GRAD, "TRAIN"))}, seen


THROUGH_A_METHOD = '''import torch
from torch import nn

torch.manual_seed(0)


class Actor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)

    def get_action(self, x):
        return torch.tanh(self(x))


actor = Actor()
opt = torch.optim.Adam(actor.parameters())
for it in range(60):
    action = actor.get_action(torch.randn(1, 4)).detach().numpy()  # ACT LINE
    loss = actor.get_action(torch.randn(32, 4)).pow(2).mean()  # TRAIN LINE
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


@pytest.mark.slow
def test_a_forward_made_in_a_method_of_its_own_module_is_named_at_the_methods_callers(tmp_path):
    """An agent that acts and trains through one method of its model (cleanrl's SAC:
    `actor.get_action(obs)` in the rollout and in the update, `self(x)` inside it): the graphs are
    told apart by the lines that called the method, so the rollout's is named, with its patch, and
    the update's is not."""
    a = _run(tmp_path, THROUGH_A_METHOD)
    act, train = (_line(THROUGH_A_METHOD, m) for m in ("ACT", "TRAIN"))
    [f] = a.rule("unused-graph")
    assert f["locations"][0]["line"] == act and "(Actor)" in f["message"]
    assert "+    with torch.no_grad():" in f["fix"]["patch"]
    forwards = {t["where"]["line"] for s in a.evidence["steps"] for t in s["tallies"] if t["kind"] == "forward"}
    assert forwards == {act, train}
