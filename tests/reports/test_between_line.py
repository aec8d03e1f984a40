"""A run that spends much of its time between its steps says so, with what ran there: a PPO-style
learner (CleanRL's ppo.py) rolls its policy out for 128 actions under no_grad between its updates,
each action fetched to the host for the environment, and that rollout took more of the run than
its 16 updates a rollout, which the median step leaves out. The run's time counts it (its
`between` part), and work-between-steps names it with its lines. A loop with a short evaluation
every few steps gets no finding (findings.json still has the record)."""
from __future__ import annotations

import html
from pathlib import Path

import pytest

from conftest import audit

ROLLOUT = '''import time

import torch
from torch import nn

torch.manual_seed(0)
policy = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2))
opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
obs = torch.zeros(32, 4)
for iteration in range(4):
    for t in range(32):  # the rollout: the environment takes each action on the host
        with torch.no_grad():
            logits = policy(obs[t:t + 1])  # ACT LINE
        action = logits.argmax(-1).cpu().numpy()  # FETCH LINE
        time.sleep(0.002)  # (the environment's step)
        obs[t] = torch.randn(4)
    for start in range(0, 32, 8):  # the update: four minibatches
        loss = policy(obs[start:start + 8]).logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
'''

EVALUATED = '''import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
x = torch.randn(64, 16)
for i in range(24):
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if i % 6 == 5:  # an evaluation of four batches: the first stays in the step (as an agent's next action)
        with torch.no_grad():
            val = sum(model(x[8 * j:8 * j + 8]).mean().item() for j in range(4))
'''


def _line(source: str, mark: str) -> int:
    return next(n for n, text in enumerate(source.splitlines(), 1) if mark in text)


def _run(tmp_path: Path, source: str):
    (tmp_path / "prog.py").write_text(source)
    a = audit("run", str(tmp_path / "prog.py"), "--steps", "200", "--to-end", "--no-profile",
              out=tmp_path / "out", env={"OMP_NUM_THREADS": "1"})
    assert a.returncode == 0, a.stderr[-3000:]
    return a


def test_a_rollout_between_the_updates_is_said_with_its_work(tmp_path: Path) -> None:
    a = _run(tmp_path, ROLLOUT)
    between = a.findings_doc["steps"]["between"]
    # the first rollout runs before the first update: it is step 0's; the next three are between
    assert between["stretches"] == 3 and between["after_steps"] == [3, 7, 11], between
    assert between["steps_per_stretch"] == 4
    stretches = [o for o in a.evidence["outside"] if o["phase"] == "between"]
    steps = [s["ms"] for s in a.evidence["steps"]]
    assert between["ms"] == round(sum(o["ms"] for o in stretches), 3)
    assert abs(between["share"] - between["ms"] / (between["ms"] + sum(steps))) < 1e-3
    assert between["median_ms"] >= 32 * 2.0  # (at least the environment's sleeps)
    work = {w["kind"]: w for w in between["work"]}
    # per stretch: 31 forwards and fetches (`.cpu().numpy()`: one) at their lines (the first of 32 is
    # the step's own tail, as an agent's next action is: one always stays in the step)
    forwards, fetches = work["module forwards"], work["device->host syncs"]
    assert forwards["lines"] == [_line(ROLLOUT, "ACT LINE")] and forwards["count"] == 31, forwards
    assert fetches["lines"] == [_line(ROLLOUT, "FETCH LINE")] and fetches["count"] == 31, fetches
    assert forwards["file"] == fetches["file"] == str(tmp_path / "prog.py")
    # the run's time holds them, and a finding names them at their lines
    account = a.findings_doc["run_time"]
    part = next(p for p in account["parts"] if p["name"] == "between")
    assert part["ms"] == pytest.approx(between["ms"], abs=0.01)
    (f,) = a.rule("work-between-steps")
    assert abs(f["cost"]["ms_per_step"] - between["ms"] / account["steps"]) < 2e-3
    assert f["cost"]["share_of_step"] >= 0.25 and f["severity"] == "warning"
    assert "3 stretches (after steps 3, 7, 11, 4 steps apart)" in f["message"], f["message"]
    assert f"module forwards x31 at prog.py line {_line(ROLLOUT, 'ACT LINE')} (" in f["message"]
    assert f"device->host syncs x31 at prog.py line {_line(ROLLOUT, 'FETCH LINE')} (" in f["message"]
    assert {(loc["file"], loc["line"]) for loc in f["locations"]} >= {(str(tmp_path / "prog.py"), _line(ROLLOUT, "ACT LINE"))}
    [line] = [ln for ln in (a.out / "summary.txt").read_text().splitlines() if ln.startswith("warning work-between-steps ")]
    assert f["message"] in line
    assert html.escape(f["message"]).replace("&#x27;", "&#39;") in (a.out / "report.html").read_text()


def test_a_short_evaluation_every_few_steps_is_not_said(tmp_path: Path) -> None:
    a = _run(tmp_path, EVALUATED)
    between = a.findings_doc["steps"]["between"]
    assert between["after_steps"] == [5, 11, 17] and between["share"] < 0.25, between
    assert a.rule("work-between-steps") == []


def test_a_loop_with_nothing_between_its_steps_has_no_record(tmp_path: Path) -> None:
    a = _run(tmp_path, EVALUATED.replace("if i % 6 == 5:", "if i < 0:"))
    assert a.findings_doc["steps"]["between"] is None
