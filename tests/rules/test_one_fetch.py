"""`x.cpu().numpy()` is one fetch from the device: the `.numpy()` reads the host copy `.cpu()` made.
A CPU-only run counted both calls, two syncs where an accelerator makes one (CleanRL's PPO: its
rollout's `envs.step(action.cpu().numpy())` read as 768 syncs for 384 actions)."""
from __future__ import annotations

from conftest import audit

PROGRAM = '''import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)


def step(i):
    out = model(torch.randn(8, 4))
    action = out.argmax(-1).cpu().numpy()  # FETCH LINE
    loss = out.pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(action.sum()) + loss.detach().numpy().sum()  # NUMPY LINE
'''


def test_a_cpu_copy_read_as_numpy_is_one_fetch(tmp_path):
    (tmp_path / "prog.py").write_text(PROGRAM)
    a = audit("run", f"{tmp_path / 'prog.py'}:step", "--steps", "6", "--no-profile", "--no-numerics", "-q",
              out=tmp_path / "out")
    assert a.returncode == 0, a.stderr[-2000:]
    lines = {mark: n for n, text in enumerate(PROGRAM.splitlines(), 1) for mark in ("FETCH", "NUMPY")
             if f"# {mark} LINE" in text}
    [f] = a.rule("host-sync")
    sites = {(s["what"], s["line"]): s["per_step"] for s in f["evidence"]["sites"]}
    # the .cpu() of the action is the fetch; its .numpy() is not counted again; a .numpy() of a
    # tensor with no .cpu() at its line (the loss's) is still counted
    assert sites == {("Tensor.cpu", lines["FETCH"]): 1.0, ("Tensor.numpy", lines["NUMPY"]): 1.0}, sites
    assert f["evidence"]["syncs_per_step"] == 2.0


ACTING = '''import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)


class Env:
    def step(self, action):
        return float(action.sum())


envs = Env()


def step(i):
    out = model(torch.randn(8, 4))
    actions = out.argmax(-1).cpu().numpy()  # ACTION LINE
    envs.step(actions)
    loss = out.pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


def test_an_action_given_to_an_environment_is_not_logging_to_thin_out(tmp_path):
    """CleanRL's DQN fetches each greedy action (`actions = q.argmax(1).cpu().numpy()`) and gives it
    to `envs.step(actions)`: the environment needs it at once, so the fix is no "log every N steps"
    setting: it says the value is needed on the host at every call."""
    (tmp_path / "prog.py").write_text(ACTING)
    a = audit("run", f"{tmp_path / 'prog.py'}:step", "--steps", "6", "--no-profile", "--no-numerics", "-q",
              out=tmp_path / "out")
    assert a.returncode == 0, a.stderr[-2000:]
    [f] = a.rule("host-sync")
    line = next(n for n, t in enumerate(ACTING.splitlines(), 1) if "# ACTION LINE" in t)
    assert [(s["what"], s["line"]) for s in f["evidence"]["sites"]] == [("Tensor.cpu", line)]
    assert f["fix"]["config"] == {} and f["fix"]["edits"] == []
    assert "an action given to an environment's step" in f["fix"]["summary"]
    assert "log every N steps" not in f["fix"]["summary"]
