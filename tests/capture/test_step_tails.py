"""Issue #35 item 8: work an iteration runs after its optimizer step (evaluation forwards under
no_grad) is counted in that iteration's step, so per-step counts of work done a whole number of
times an iteration are whole. Programs in the shape of pytorch/examples gat/main.py (Adam, then
two `test()` forwards each `.item()`-ing twice) and time_sequence_prediction (LBFGS with a
closure, then one no_grad prediction), from tests/data/public_shapes."""
from __future__ import annotations

import pytest

from conftest import ROOT, audit

SHAPES = ROOT / "tests" / "data" / "public_shapes"


def _sites(a) -> dict[int, float]:
    [sync] = [f for f in a.rule("host-sync") if "phase" not in f["evidence"]]
    return {s["line"]: s["per_step"] for s in sync["evidence"]["sites"]}


def _after(a) -> dict[int, int]:
    after = [f for f in a.rule("host-sync") if f["evidence"].get("phase") == "after"]
    return {s["line"]: s["count"] for f in after for s in f["evidence"]["sites"]}


@pytest.mark.slow
def test_gat_shaped_evaluation_after_the_optimizer_step_is_in_its_step(tmp_path):
    prog = SHAPES / "gat_main.py"
    a = audit("run", str(prog), "--no-profile", "--no-numerics", "--quiet", out=tmp_path / "o")
    assert a.returncode == 0, a.stderr[-3000:]
    item_line = next(n for n, ln in enumerate(prog.read_text().splitlines(), 1) if "return loss.item(), acc.item()" in ln)
    # 6 epochs, each two test() calls of two .item(): 4 a step, not 3.33 (the first step without
    # its evaluation, each later one with its predecessor's)
    assert _sites(a) == {item_line: 4.0}
    # the final test() after the loop is outside the steps, not the last step's
    assert _after(a) == {item_line: 2}


@pytest.mark.slow
def test_lbfgs_shaped_prediction_after_the_step_is_in_its_step(tmp_path):
    prog = SHAPES / "time_sequence_prediction.py"
    a = audit("run", str(prog), "--no-profile", "--no-numerics", "--quiet", out=tmp_path / "o")
    assert a.returncode == 0, a.stderr[-3000:]
    lines = prog.read_text().splitlines()
    closure_item = next(n for n, ln in enumerate(lines, 1) if 'print("loss:", loss.item())' in ln)
    test_item = next(n for n, ln in enumerate(lines, 1) if 'print("test loss:", loss.item())' in ln)
    numpy_line = next(n for n, ln in enumerate(lines, 1) if "pred.detach().numpy()" in ln)
    # LBFGS(max_iter=4): 4 closure calls a step, then one prediction: x1, not x0.667
    assert _sites(a) == {closure_item: 4.0, test_item: 1.0, numpy_line: 1.0}
    assert _after(a) == {}
