"""grad-explosion on the shapes of real programs: x-transformers' train_parity (a length curriculum
under `clip_grad_norm_(..., 0.5)`), and a trainer whose SGD learning rate is far too large (its
gradient norms grow at every step until they are non-finite)."""
from __future__ import annotations

from conftest import ONE_THREAD, audit
from auditor.evidence.load import load_paths
from auditor.rules import grad_explosion
from auditor.rules.grad_explosion import GradExplosion

# train_parity's shape: the task moves to its next stage once the loss is low enough; the loss
# jumps from ~0.001 to ~8 there, and the gradient norm with it, which the program clips at 0.5
CURRICULUM = '''
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
x = torch.randn(64, 16)
with torch.no_grad(): model[2].weight.mul_(0.1)
stage = 1  # the curriculum's stage: which class the targets are

def step(i):
    global stage
    y = torch.full((64,), stage - 1)
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # CLIP LINE
    opt.step()
    if loss.item() < 0.001 and stage == 1:
        stage += 1
        print(f"criteria met, incrementing to {stage}")
    return loss.item()
'''

DIVERGING = '''
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.015)
x = torch.randn(256, 64)
y = x.sum(1, keepdim=True) * 6

def step(i):
    opt.zero_grad()
    loss = (model(x) - y).pow(2).mean()
    loss.backward()
    opt.step()
    return loss.item()
'''


def _audit(tmp_path, name: str, source: str, steps: int, *extra: str):
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    a = audit("run", f"{path}:step", "--steps", str(steps), "--quiet", *extra, out=tmp_path / name, env=ONE_THREAD)
    assert a.returncode == 0, a.stderr[-3000:]
    return a


def _norms(a) -> list[tuple[int, float]]:
    return [(d["index"], r["grad_norm"]) for d in a.evidence["steps"]
            for r in ((d.get("numerics") or {}).get("opt_steps") or []) if "grad_norm" in r]


def _losses(a) -> dict[int, float]:
    return {d["index"]: d["numerics"]["loss"] for d in a.evidence["steps"]
            if (d.get("numerics") or {}).get("loss") is not None}


def test_a_norm_at_the_programs_clip_at_a_curriculum_step_is_not_an_explosion(tmp_path, monkeypatch):
    """The rule read the clipped norm: 0.5 at the stage change, ~50x the norms before it, and
    reported an explosion with a max_norm under the program's own clip. The clip is recorded, a
    norm at it is clipped, and the stage change (the loss jumped with the norm, then fell) is not
    an explosion; without the clip, the unclipped jump at the stage change is not one either."""
    a = _audit(tmp_path, "clipped", CURRICULUM, 29, "--no-profile")  # (every step to 24 checked)
    assert "criteria met, incrementing to 2" in a.stdout
    assert not a.rule("grad-explosion"), a.rule("grad-explosion")[0]["message"]
    [clip] = [e for d in a.evidence["steps"] for e in (d.get("numerics") or {}).get("events") or []
              if e.get("event") == "clip"]
    assert clip["limit"] == 0.5 and clip["opt"] == 0 and clip["where"]["line"] == \
        CURRICULUM.splitlines().index("    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # CLIP LINE") + 1
    norms, losses = _norms(a), _losses(a)
    change = next(s for s in sorted(losses) if s > 0 and losses[s] > 1000 * losses[s - 1])
    at = dict(norms)[change]
    assert abs(at - 0.5) < 1e-5 and at > max(v for s, v in norms if s < change)  # what fired before
    # each reason alone keeps it silent: the clip without the curriculum's, and (below) the
    # curriculum's without a clip; with neither, the rule reports the jump to the clip, as it did
    ev = load_paths([a.out])
    monkeypatch.setattr(grad_explosion, "_loss_jumped", lambda *args: False)
    assert not list(GradExplosion().check(ev, GradExplosion.default_options()))
    monkeypatch.setattr(grad_explosion, "_clip_limit", lambda *args: None)
    [old] = GradExplosion().check(ev, GradExplosion.default_options())
    assert old.message.startswith("The gradient norm spiked: clip it or lower the learning rate. "
                                  f"The gradient norm jumped to 0.5 at step {change}")
    monkeypatch.undo()

    free = _audit(tmp_path, "unclipped", CURRICULUM.replace("    torch.nn.utils.clip_grad_norm_", "    # "), 29,
                  "--no-profile")
    norms, losses = _norms(free), _losses(free)
    change = next(s for s in sorted(losses) if s > 0 and losses[s] > 1000 * losses[s - 1])
    before = sorted(v for s, v in norms if change - 5 <= s < change)
    assert dict(norms)[change] > 100 * before[len(before) // 2]  # a jump spike-ratio would call a spike
    assert not free.rule("grad-explosion"), free.rule("grad-explosion")[0]["message"]


def test_norms_that_grow_until_they_are_non_finite_are_reported_as_that_growth(tmp_path):
    """SGD with too large a learning rate: the norm rises at every step and is non-finite five
    steps in. Reported before as a jump at step 3 (800x the median before it), as if the first
    steps were the healthy ones to clip at; it is the growth from the first step."""
    a = _audit(tmp_path, "diverging", DIVERGING, 8, "--no-profile")
    norms = _norms(a)
    bad = next(k for k, (_, v) in enumerate(norms) if not isinstance(v, float))
    fin = norms[:bad]
    assert len(fin) >= 3 and all(b[1] > a_[1] for a_, b in zip(fin, fin[1:]))
    [g] = a.rule("grad-explosion")
    assert g["evidence"]["spike"] is None and g["evidence"]["growth"]["rising"]
    assert g["message"].startswith(
        "The gradient norm keeps growing: lower the learning rate. "
        f"The gradient norm grew at every step seen, from {fin[0][1]:.3g} at step {fin[0][0]} to "
        f"{fin[-1][1]:.3g} at step {fin[-1][0]} (x{fin[-1][1] / fin[0][1]:.3g} over {len(fin)} steps measured), "
        f"then turned non-finite at step {norms[bad][0]}"), g["message"]
    assert g["fix"]["config"] == {"lr": 0.0015}
