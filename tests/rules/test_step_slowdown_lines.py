"""step-slowdown names the line whose time grew when the growth is outside the probed phases (a
running metric that re-concatenates every past batch), from the per-line time of each step."""
from __future__ import annotations

import sys

import pytest

from auditor.capture.lines import INTERVAL_S
from conftest import EXAMPLES, expected_lines

pytestmark = pytest.mark.slow


def test_the_growing_line_outside_the_phases_is_named(example_audit):
    """(The 72-step audit the next test reads: its dense start is 40 steps of per-line times, then
    the sampled ones.)"""
    a = example_audit("step_slowdown_metric", steps=72)
    assert a.returncode == 0, a.stderr[-3000:]
    [f] = a.rule("step-slowdown")
    example = EXAMPLES / "step_slowdown_metric.py"
    [line] = expected_lines(example, "step-slowdown")
    assert (f["locations"][0]["file"], f["locations"][0]["line"]) == (str(example), line)
    phase = f["evidence"]["growing_phase"]
    assert phase["kind"] == "line-time" and phase["line"] == line
    # the line's growth, measured as the step's rise is, is part of that rise (sampled every 2 ms:
    # noisy on steps of a few ms); the probed phases (forward, backward, optimizer) grew less
    rise = f["evidence"]["rise_ms"]
    assert 0 < phase["growth_ms"] and phase.get("phase_growth_ms", 0.0) < phase["growth_ms"]
    assert rise > 0
    assert f"The time spent at line {line} of step_slowdown_metric.py (`drift = torch.cat(history)" in f["message"]
    assert "the growth is this line's own" in f["message"]
    # every step carries its per-line times
    lines = [t for s in a.evidence["steps"] for t in s["tallies"] if t["kind"] == "line-time"]
    assert lines and all(t["ms"] > 0 and t["count"] >= 1 for t in lines)


def test_the_line_is_named_from_the_sampled_steps_after_the_dense_start(example_audit):
    """After the dense start (40 steps) the line sampler looks at one step in 16 (the others carry no
    per-line times, and say so): the growing line is still named, its rise read over the sampled
    steps only."""
    a = example_audit("step_slowdown_metric", steps=72)
    assert a.returncode == 0, a.stderr[-3000:]
    steps = a.evidence["steps"]
    sampled = [s["index"] for s in steps if s["lines_sampled"]]
    with_lines = [s["index"] for s in steps if any(t["kind"] == "line-time" for t in s["tallies"])]
    profiled = [s["index"] for s in steps if s["profiled"]]
    assert set(with_lines) <= set(sampled)
    # A sampled step carries line times where the sampler got to look: a look comes INTERVAL_S after
    # the step starts and needs the interpreter's lock, which the step's thread gives up at the latest
    # after the switch interval. So a step may go unlooked only where it is that short, or is one of
    # the first three (the warm-up step, and ~3 ms steps on a quiet machine), and few do
    ms = {s["index"]: s["ms"] for s in steps}
    unlooked = set(sampled) - set(with_lines)
    short = 1e3 * (INTERVAL_S + sys.getswitchinterval())
    assert len(unlooked) <= 4 and all(i < 3 or ms[i] < short for i in unlooked), {i: ms[i] for i in unlooked}
    assert [i for i in sampled if i >= 40] in ([40, 56], [40, 57], [41, 56], [41, 57])  # (a checked step: the next)
    assert set(range(40)) - set(profiled) <= set(sampled)
    [f] = a.rule("step-slowdown")
    [line] = expected_lines(EXAMPLES / "step_slowdown_metric.py", "step-slowdown")
    phase = f["evidence"]["growing_phase"]
    assert phase["kind"] == "line-time" and phase["line"] == line and phase["growth_ms"] > 0
    # and the finding says what the line's rise is read over
    assert 4 <= phase["sampled_steps"] < f["evidence"]["steps_used"]
    assert (f"grew the most (read over the {phase['sampled_steps']} of {f['evidence']['steps_used']} steps the "
            "line sampler looked at)") in f["message"]
