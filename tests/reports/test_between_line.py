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


EVALUATED_AT_ZERO = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
train = DataLoader(TensorDataset(torch.randn(768, 16)), batch_size=64)
val = DataLoader(TensorDataset(torch.randn(25600, 16)), batch_size=64)
for i, (x,) in enumerate(train):
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if i % 500 == 0:  # an evaluation at iteration 0, then every 500 (minGPT's adder, nanoGPT's)
        with torch.no_grad():
            score = sum(model(v).mean() for (v,) in val)  # EVAL LINE
'''


def test_one_stretch_in_steps_cut_short_is_not_a_cost_a_step(tmp_path: Path) -> None:
    """minGPT's adder evaluates at iteration 0, then every 500: `--steps 8` sees that evaluation
    once, after step 0, which says nothing of how often it comes back. It was a warning costing its
    time over the 8 steps (36% of minGPT's run, "evaluate less often" to a program that evaluates
    every 500 iterations); it is said once, as a time, with no cost a step. Run to its end, the same
    stretch is that run's own, its cost a step measured."""
    (tmp_path / "prog.py").write_text(EVALUATED_AT_ZERO)
    a = audit("run", "prog.py", "--steps", "8", "--no-profile", out=tmp_path / "out", cwd=tmp_path,
              env={"OMP_NUM_THREADS": "1"})
    assert a.returncode == 0, a.stderr[-3000:]
    between = a.findings_doc["steps"]["between"]
    assert between["stretches"] == 1 and between["after_steps"] == [0], between
    (f,) = a.rule("work-between-steps")
    assert f["severity"] == "info" and f["cost"]["ms_per_step"] is None, f
    assert f["cost"]["note"] == f"{between['ms'] / 1000:.2f} s once"
    assert f["message"].startswith("Work after step 0 of 8: how often it recurs is not seen. It ran once between "
                                   f"the audited steps and took {between['ms'] / 1000:.2f} s (")
    [line] = [ln for ln in a.stdout.splitlines() if ln.startswith("info    work-between-steps")]
    assert line.endswith(" s once Work after step 0 of 8: how often it recurs is not seen."), line
    assert f"module forwards x400 at prog.py line {_line(EVALUATED_AT_ZERO, 'EVAL LINE')} (" in f["message"], f["message"]
    assert "fixes give back" not in a.stdout
    (tmp_path / "whole").mkdir()
    whole = _run(tmp_path / "whole", EVALUATED_AT_ZERO)
    (f,) = whole.rule("work-between-steps")
    assert f["severity"] == "warning" and f["cost"]["ms_per_step"] > 0, f
