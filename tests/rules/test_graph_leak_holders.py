"""graph-leak names every line that stores a graph into one holder, and the patch detaches each."""
from __future__ import annotations

import pytest

from conftest import EXAMPLES, expected_lines

pytestmark = pytest.mark.slow


def test_each_line_storing_into_one_holder_is_named_and_patched(example_audit):
    a = example_audit("graph_leak_holders", steps=8)
    assert a.returncode == 0, a.stderr[-3000:]
    [f] = a.rule("graph-leak")
    example = EXAMPLES / "graph_leak_holders.py"
    lines = expected_lines(example, "graph-leak")
    assert lines == [17, 18]
    assert [(loc["file"], loc["line"]) for loc in f["locations"]] == [(str(example), n) for n in lines]
    assert "held by `stats` (stored into at lines 17, 18)" in f["message"]
    [holder] = f["evidence"]["holders"]
    assert holder["name"] == "stats" and holder["lines"] == [17, 18]
    # a loss and 4 output rows a step: every step's graph is kept (12 nodes per step here)
    assert f["evidence"]["nodes_per_step"] == 12.0
    assert [(e["start"], e["lines"]) for e in f["fix"]["edits"]] == [
        (17, ['    stats["loss"] += loss.detach()  # expect: graph-leak']),
        (18, ['    stats["outputs"].append(out[:4].detach())  # expect: graph-leak'])]
    assert f["fix"]["changes_numerics"] is False
