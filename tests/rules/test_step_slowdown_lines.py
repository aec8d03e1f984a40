"""step-slowdown names the line whose time grew when the growth is outside the probed phases (a
running metric that re-concatenates every past batch), from the per-line time of each step."""
from __future__ import annotations

import pytest

from conftest import EXAMPLES, expected_lines

pytestmark = pytest.mark.slow


def test_the_growing_line_outside_the_phases_is_named(example_audit):
    a = example_audit("step_slowdown_metric", steps=30)
    assert a.returncode == 0, a.stderr[-3000:]
    [f] = a.rule("step-slowdown")
    example = EXAMPLES / "step_slowdown_metric.py"
    [line] = expected_lines(example, "step-slowdown")
    assert (f["locations"][0]["file"], f["locations"][0]["line"]) == (str(example), line)
    phase = f["evidence"]["growing_phase"]
    assert phase["kind"] == "line-time" and phase["line"] == line
    # the line's growth, measured as the step's rise is, is part of that rise (sampled every 2 ms:
    # noisy on steps of a few ms); the probed phases (forward, backward, optimizer) grew less
    rise = f["cost"]["ms_per_step"]
    assert 0 < phase["growth_ms"] and phase.get("phase_growth_ms", 0.0) < phase["growth_ms"]
    assert rise > 0
    assert f"The time spent at line {line} of step_slowdown_metric.py (`drift = torch.cat(history)" in f["message"]
    assert "the growth is this line's own" in f["message"]
    # every step carries its per-line times
    lines = [t for s in a.evidence["steps"] for t in s["tallies"] if t["kind"] == "line-time"]
    assert lines and all(t["ms"] > 0 and t["count"] >= 1 for t in lines)
