"""Holders that are no module's globals: a running loss kept as a tensor in a local of the function
that holds the training loop (most loops live in functions), run as a package with `audit run -m`;
and a holder a library caps (LBFGS's history), whose filling is no growth."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import ROOT, audit

DATA = ROOT / "tests" / "data"
PKG = DATA / "local_leak_pkg" / "__main__.py"


def _line(path: Path, mark: str) -> int:
    return next(n for n, text in enumerate(path.read_text().splitlines(), 1) if mark in text)


@pytest.mark.slow
def test_a_running_sum_in_a_functions_local_is_named_with_its_function_and_line(tmp_path):
    a = audit("run", "-m", "local_leak_pkg", "--steps", "30", "--quiet", "--no-profile", out=tmp_path / "leak",
              cwd=DATA)
    assert a.returncode == 0, a.stderr[-2000:]
    [leak] = a.rule("graph-leak")
    line = _line(PKG, "LEAK LINE")
    assert "held by `total` (a local of `train()`, at __main__.py:25)" in leak["message"], leak["message"]
    assert [(loc["file"], loc["line"]) for loc in leak["locations"]] == [(str(PKG), line)]
    assert leak["evidence"]["holders"][0]["function"] == "train"
    [edit] = leak["fix"]["edits"]
    assert edit["start"] == line and "total += loss.detach()" in edit["lines"][0]
    # the clean twin keeps `loss.item()`: nothing is held
    c = audit("run", "-m", "local_leak_pkg", "--steps", "30", "--quiet", "--no-profile", out=tmp_path / "clean",
              cwd=DATA, env={"LOCAL_LEAK_CLEAN": "1"})
    assert c.returncode == 0, c.stderr[-2000:]
    assert not c.rule("graph-leak") and not c.rule("memory-growth")


@pytest.mark.slow
def test_lbfgs_history_is_capped_and_no_growth(tmp_path):
    """LBFGS adds a (direction, step) pair per inner iteration, up to history_size (100): its state
    fills over the first steps, then stays. Today's code called that growth ("another 1,000 steps
    add 9.6 GiB")."""
    a = audit("run", str(DATA / "lbfgs_sequence.py"), "--steps", "4", "--quiet", "--no-profile", out=tmp_path / "o")
    assert a.returncode == 0, a.stderr[-2000:]
    assert not a.rule("memory-growth"), a.rule("memory-growth")[0]["message"]
