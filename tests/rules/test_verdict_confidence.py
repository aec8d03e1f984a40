"""dataloader-bound's verdict is taken on each step's own share of its time and says how sure it is."""
from __future__ import annotations

import pytest

from auditor.rules._support.confidence import share_confidence as _confidence


def test_confidence_levels_follow_the_spread_of_the_steps_shares():
    high, text = _confidence([0.5] * 18 + [0.1, 0.2], 0.25, [1.0] * 20)
    assert high["confidence"] == "high" and high["steps_over_min_share"] == 18 and high["steps_timed"] == 20
    assert text == ("Confidence: high (18 of 20 steps waited 0.25 of their time or more; the middle half of "
                    "the steps, 0.50-0.50 of theirs).")
    # at the threshold: half the steps above it, half below
    low, _ = _confidence([0.2, 0.3] * 10, 0.25, [1.0] * 20)
    assert low["confidence"] == "low"
    medium, _ = _confidence([0.3] * 14 + [0.1] * 3 + [0.5] * 3, 0.25, [1.0] * 20)
    assert medium["confidence"] == "medium"
    # fewer than 4 steps timed (pytorch/examples dcgan's 16 steps on fake data, 15 of them checked
    # or profiled, read "high" from 1 step): too few to be sure of, whatever they waited
    few, _ = _confidence([0.9] * 3, 0.25, [1.0] * 3)
    assert few["confidence"] == "low"
    # a process kept off the cores (CPU 40% of wall) is said to be
    _, loaded = _confidence([0.5] * 20, 0.25, [0.4] * 20)
    assert "the process had the CPU 0.40 of its wall time" in loaded


@pytest.mark.slow
def test_dataloader_bound_states_its_confidence(example_audit):
    a = example_audit("dataloader_bound")
    [f] = a.rule("dataloader-bound")
    ev = f["evidence"]
    q1, q2, q3 = ev["step_share_quartiles"]
    # judged on the steps the median step is of: the timed ones (neither profiled nor checked)
    timed = [s for s in a.evidence["steps"] if not s["profiled"] and not s["failed"] and s.get("numerics") is None]
    assert q1 <= q2 <= q3 and ev["steps_timed"] == len(timed) >= 15 and ev["confidence"] in ("high", "medium")
    assert f"Confidence: {ev['confidence']} ({ev['steps_over_min_share']} of {ev['steps_timed']} steps" in f["message"]
