"""step-slowdown says how sure its verdict is, in dataloader-bound's vocabulary: the early and late
windows' spread and the rise against the steps' scatter about the trend line."""
from __future__ import annotations

import pytest

from conftest import growing_run

from auditor.rules._support.confidence import trend_confidence


def test_trend_confidence_levels():
    line = [10.0 + 0.5 * i for i in range(20)]
    # steps on a steep line, apart early and late: high
    high, text = trend_confidence([y + (0.1 if i % 2 else -0.1) for i, y in enumerate(line)], line, 9.5, 1.3, 1.9,
                                  "CPU", 0.5)
    assert high["confidence"] == "high" and high["judged_on"] == "CPU" and high["steps_timed"] == 20
    assert high["early_quartiles_ms"][2] < high["late_quartiles_ms"][0] and high["rise_over_scatter"] > 3
    assert text.startswith("Confidence: high (the middle half of the first 5 steps took 10.6-11.6 ms of CPU time, "
                           "of the last 5 17.9-18.9 ms; the rise is ")
    assert "the process had the CPU 0.50 of its wall time" in text
    # a rise lost in the scatter, windows overlapping: low
    noisy = [10.0 + (8.0 if i % 2 else -8.0) + 0.3 * i for i in range(20)]
    low, text = trend_confidence(noisy, [10.0 + 0.3 * i for i in range(20)], 5.7, 1.3, 1.4, "wall", None)
    assert low["confidence"] == "low" and ", overlapping;" in text and low["cpu_over_wall"] is None


@pytest.mark.slow
def test_step_slowdown_states_its_confidence(tmp_path_factory):
    a = growing_run(tmp_path_factory)  # (GROWING, 18 steps: the session's one run of it, test_step_slowdown's too)
    assert a.returncode == 0, a.stderr
    [f] = a.rule("step-slowdown")
    ev = f["evidence"]
    assert ev["confidence"] in ("high", "medium", "low") and ev["judged_on"] == "CPU"
    assert ev["steps_timed"] == ev["steps_used"] and ev["cpu_over_wall"] is not None
    e1, l1 = ev["early_quartiles_ms"], ev["late_quartiles_ms"]
    assert e1[0] <= e1[1] <= e1[2] and l1[0] <= l1[1] <= l1[2] and l1[1] > e1[1]
    assert f["message"].rstrip().endswith(")."), f["message"]
    assert f"Confidence: {ev['confidence']} (the middle half of the first " in f["message"]
