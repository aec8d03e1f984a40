"""torch.distributions checks a distribution's arguments when it is made, and the value given to its
log_prob, by default, and tests each check's result on the host: a sync each on a GPU, made inside
torch at the user's line. CleanRL's SAC makes a Normal and calls its log_prob in every actor call
(12 such syncs a step), its PPO a Categorical: host-sync saw none of them (torch calling itself was
dropped). They are counted at the user's lines, with the setting that turns them off; a program that
turned them off has none."""
from __future__ import annotations

from conftest import audit, graded_severity

PROGRAM = '''import torch
from torch import nn

VALIDATE
device = "cuda"
torch.manual_seed(0)
actor = nn.Sequential(nn.Linear(3, 32), nn.Tanh(), nn.Linear(32, 2)).to(device)
opt = torch.optim.Adam(actor.parameters(), lr=1e-3)
obs = torch.randn(64, 3, device=device)
for it in range(12):
    mean, log_std = actor(obs).chunk(2, dim=-1)
    normal = torch.distributions.Normal(mean, log_std.exp())  # MAKE LINE
    x = normal.rsample()
    log_prob = normal.log_prob(x)  # LOG_PROB LINE
    loss = (log_prob - x.pow(2)).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


def _audit(tmp_path, validate: str = "", *more: str):
    source = PROGRAM.replace("VALIDATE", validate)
    (tmp_path / "train.py").write_text(source)
    a = audit("run", str(tmp_path / "train.py"), "--steps", "10", "--no-profile", "--no-numerics", "-q", *more,
              out=tmp_path / "out", cwd=tmp_path)
    assert a.returncode == 0, a.stderr[-3000:]
    assert a.evidence["environment"]["rehearsal"] is True
    lines = {mark: n for n, text in enumerate(source.splitlines(), 1) for mark in ("MAKE", "LOG_PROB")
             if f"# {mark} LINE" in text}
    return a, lines


def test_the_argument_checks_are_counted_at_the_users_lines_with_their_setting(tmp_path):
    a, lines = _audit(tmp_path)
    [f] = a.rule("host-sync")
    sites = {(s["what"], s["line"]): s for s in f["evidence"]["sites"]}
    # Normal(loc, scale): two arguments checked, two syncs; log_prob(x): the value checked, one
    made, given = sites[("torch.distributions argument check", lines["MAKE"])], \
        sites[("torch.distributions argument check", lines["LOG_PROB"])]
    assert made["per_step"] == 2 and given["per_step"] == 1, sites
    assert len(sites) == 2 and f["evidence"]["syncs_per_step"] == 3
    assert f["severity"] == graded_severity(f, a.findings_doc) and "On the GPU these synchronise: 3 device->host syncs" in f["message"]
    assert f["fix"]["config"] == {"torch.distributions.Distribution.set_default_validate_args": False}
    assert "set_default_validate_args(False)" in f["fix"]["summary"]
    assert {loc["line"] for loc in f["locations"]} == {lines["MAKE"], lines["LOG_PROB"]}
    # the patch turns them off after the imports at the file's head (`import torch`, `from torch import nn`)
    [edit] = f["fix"]["edits"]
    assert (edit["start"], edit["end"]) == (3, 2) and edit["lines"] == [
        "torch.distributions.Distribution.set_default_validate_args(False)  # auditor: host-sync"]


def test_the_patch_that_turns_them_off_is_verified(tmp_path):
    """--verify re-runs the program with fixes.patch: the syncs are gone, the weights the same."""
    a, _ = _audit(tmp_path, "", "--verify")
    [f] = a.rule("host-sync")
    v = f["fix"]["verified"]
    assert v["status"] == "improved" and v["after"]["finding"] is False, v
    assert v["before"]["weights"] == v["after"]["weights"], v  # (changed results are "changed-results")


def test_a_program_that_turned_the_checks_off_has_none(tmp_path):
    a, _ = _audit(tmp_path, "torch.distributions.Distribution.set_default_validate_args(False)")
    assert a.rule("host-sync") == []
