"""zero-gradients on examples/numerics_zero_grad.py (pytorch/examples' DDP tutorial's training:
nn.Linear(20, 1) and cross_entropy on a float target, so the loss is 0 and every gradient exactly 0),
audited as the numerics examples are; silent on the examples that learn (the rule table's clean
twin, and here every other numerics example)."""
from __future__ import annotations

from conftest import EXAMPLES, NUMERICS_STEPS, ONE_THREAD, audit, expected_lines


def test_every_gradient_zero_is_found_at_the_loss_line(numerics_audit):
    a = numerics_audit("numerics_zero_grad")
    assert a.returncode == 0, a.stderr[-3000:]
    [f] = a.rule("zero-gradients")
    example = EXAMPLES / "numerics_zero_grad.py"
    assert [(loc["file"], loc["line"]) for loc in f["locations"]] == \
        [(str(example), n) for n in expected_lines(example, "zero-gradients")]
    ev = f["evidence"]
    n = NUMERICS_STEPS["numerics_zero_grad"]
    assert ev["optimizer"] == "SGD" and ev["steps_measured"] == n and ev["steps"] == list(range(n))
    assert ev["loss_constant"] is True and ev["losses"] == [0.0] * n
    assert ev["loss_op"].endswith("cross_entropy") and ev["lrs"] == [1e-3]
    assert f"exactly zero at every one of the {n} optimizer steps" in f["message"]
    assert "an output of one column" in f["message"] and "mse_loss" in f["fix"]["summary"]


def test_a_run_that_learns_has_no_zero_gradients(numerics_audit):
    for name in ("numerics_clean", "numerics_lr_warmup", "numerics_log_zero"):
        a = numerics_audit(name)
        assert a.rule("zero-gradients") == [], name


MISPLACED = '''import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(40):
    x = torch.randn(32, 8)
    loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
    loss.backward()
    opt.zero_grad(set_to_none=False)  # clears the gradients before the update
    opt.step()  # STEP
'''


def _misplaced_finding(tmp_path, set_to_none: bool) -> dict:
    """MISPLACED (zero_grad(set_to_none=...) between backward() and step()) audited for 12 steps:
    its one zero-gradients finding, located at its optimizer step's line."""
    (tmp_path / "train.py").write_text(MISPLACED.replace("set_to_none=False", f"set_to_none={set_to_none}"))
    a = audit("run", str(tmp_path / "train.py"), "--steps", "12", "--no-profile", "-q", out=tmp_path / "o",
              cwd=tmp_path, env=ONE_THREAD)
    assert a.returncode == 0, a.stderr[-3000:]
    [f] = a.rule("zero-gradients")
    step_line = next(n for n, ln in enumerate(MISPLACED.splitlines(), 1) if "# STEP" in ln)
    assert [loc["line"] for loc in f["locations"]] == [step_line]
    return f


def test_gradients_cleared_before_the_update_are_found_at_the_step(tmp_path):
    """A loss that moves (mse on fresh data) depends on the output, so zero gradients were lost on
    the way: here `zero_grad(set_to_none=False)` between backward() and step(). Named at the step's
    line, with that cause and its fix, not the loss's."""
    f = _misplaced_finding(tmp_path, set_to_none=False)
    ev = f["evidence"]
    assert ev["loss_moved"] is True and ev["loss_constant"] is False and ev["steps_measured"] == 12
    assert len(set(ev["losses"])) > 1 and ev["loss_op"].endswith("mse_loss")
    assert "cleared between backward() and step()" in f["message"]
    assert "never between them" in f["fix"]["summary"]


def test_gradients_set_to_none_before_the_update_are_found_at_the_step(tmp_path):
    """The same misplaced zero_grad() with torch's default (set_to_none=True): every `.grad` is None
    at the update, which then skips every parameter, though each step ran a backward pass."""
    f = _misplaced_finding(tmp_path, set_to_none=True)
    assert f["evidence"]["no_grads"] is True and f["evidence"]["steps_measured"] == 12
    assert "None of the parameters SGD updates had a gradient" in f["message"]
    assert "set_to_none=True" in f["message"] and "never between them" in f["fix"]["summary"]
