"""Module state that keeps tensors inside rows: a replay buffer is a list (or deque) of tuples,
dicts or small objects, not of bare tensors. graph-leak and memory-growth see through the rows."""
from __future__ import annotations

import pytest

from conftest import audit

REPLAY = '''
from collections import deque
from dataclasses import dataclass
import torch
from torch import nn

torch.manual_seed(0)
policy = nn.Linear(16, 4)
opt = torch.optim.SGD(policy.parameters(), lr=1e-3)
replay = {holder}


@dataclass
class Transition:
    obs: torch.Tensor
    logp: torch.Tensor
    reward: float


def step(i):
    obs = torch.randn(80, 64, 64)  # a frame: 1.25 MiB
    logp = policy(obs.mean(0)[:, :16]).log_softmax(-1)[:, 0]  # carries the graph
    replay.append({row})  # APPEND LINE: never evicted, graph kept
    loss = -logp.mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
'''

ROWS = {
    "tuple": ("[]", "(obs, logp, 1.0)"),
    "dict": ("deque()", '{"obs": obs, "logp": logp, "reward": 1.0}'),
    "object": ("[]", "Transition(obs, logp, 1.0)"),
}


@pytest.mark.parametrize("kind", list(ROWS))
def test_a_replay_buffer_of_rows_is_seen(tmp_path, kind):
    holder, row = ROWS[kind]
    source = REPLAY.replace("{holder}", holder).replace("{row}", row)
    path = tmp_path / "rl.py"
    path.write_text(source)
    a = audit("run", f"{path}:step", "--steps", "20", "--quiet", "--no-profile", "--no-numerics", out=tmp_path / "out",
              env={"OMP_NUM_THREADS": "1"})
    assert a.returncode == 0, a.stderr[-2000:]
    line = next(n for n, text in enumerate(source.splitlines(), 1) if "# APPEND LINE" in text)
    [leak] = a.rule("graph-leak")
    assert "held by `replay`" in leak["message"], leak["message"]
    assert [(loc["file"], loc["line"]) for loc in leak["locations"]] == [(str(path), line)]
    # no patch: `.detach()` on a row would fail (a tuple has none; its float neither)
    assert leak["fix"]["patch"] is None
    [growth] = a.rule("memory-growth")
    [held] = growth["evidence"]["holders"]
    assert "`replay`" in growth["message"] and held["name"] == "replay" and held["tensors"] == 40
    frame = 80 * 64 * 64 * 4
    assert 18 * frame <= held["growth_bytes"] < 18 * frame + 2**16  # a frame a step, scans at steps 1 and 19
