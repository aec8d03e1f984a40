"""zero-gradients on examples/numerics_zero_grad.py (pytorch/examples' DDP tutorial's training:
nn.Linear(20, 1) and cross_entropy on a float target, so the loss is 0 and every gradient exactly 0),
audited as the numerics examples are; silent on the examples that learn (the rule table's clean
twin, and here every other numerics example)."""
from __future__ import annotations

from conftest import EXAMPLES, NUMERICS_STEPS, expected_lines


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
