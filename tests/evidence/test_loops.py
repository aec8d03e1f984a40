"""auditor.evidence.loops: a run's steps split into the training loops they came from, where no
step after a point ran any forward, backward or optimizer call of a step before it. (The real runs:
tests/rules/test_step_slowdown_loops.py, whose two loops the summary and the audit's own cost
name.)"""
from __future__ import annotations

from auditor.evidence import model as m
from auditor.evidence.frame import Frame
from auditor.evidence.loops import MIN_LOOP, loops, medians


def _step(i: int, *calls: tuple[str, str, int], ms: float = 10.0) -> m.StepRecord:
    return m.StepRecord(index=i, start_s=i * 0.01, ms=ms, cpu_ms=ms, tallies=[
        m.Tally(kind=kind, what=what, where=Frame(file="/p/train.py", line=line, function="f", code=""), count=1)
        for kind, what, line in calls])


TRAIN = (("forward", "Net", 10), ("backward", "Tensor.backward", 11), ("optimizer", "SGD", 12))
OTHER = (("forward", "Big", 20), ("backward", "Tensor.backward", 21), ("optimizer", "Adam", 22))
EVAL = (("forward", "Net", 14),)


def _spans(parts):
    return [(p[0].index, p[-1].index) for p in parts]


def test_two_loops_of_other_code_split_where_the_second_begins():
    steps = [_step(i, *TRAIN) for i in range(10)] + [_step(i, *OTHER, ms=30.0) for i in range(10, 25)]
    parts = loops(steps)
    assert _spans(parts) == [(0, 9), (10, 24)]
    assert medians(parts, steps) == [10.0, 30.0]
    assert medians(parts, steps[:5]) == [10.0, None]  # (a loop with none of the basis' steps)


def test_an_evaluation_every_k_steps_or_an_odd_first_step_splits_nothing():
    steps = [_step(0, *TRAIN, ("forward", "Net", 5))]  # (a model summary's forward in the first step)
    steps += [_step(i, *TRAIN, *(EVAL if i % 5 == 0 else ())) for i in range(1, 30)]
    assert _spans(loops(steps)) == [(0, 29)]


def test_a_stretch_shorter_than_a_loop_joins_its_neighbour_and_code_run_again_joins_all():
    short = [_step(i, *TRAIN) for i in range(MIN_LOOP - 1)] + [_step(i, *OTHER) for i in range(MIN_LOOP - 1, 20)]
    assert _spans(loops(short)) == [(0, 19)]
    tail = [_step(i, *TRAIN) for i in range(20)] + [_step(20, *OTHER)]
    assert _spans(loops(tail)) == [(0, 20)]
    # the first loop's code run again after the second: no point has nothing of both sides
    again = [_step(i, *TRAIN) for i in range(10)] + [_step(i, *OTHER) for i in range(10, 20)] + \
        [_step(i, *TRAIN) for i in range(20, 30)]
    assert _spans(loops(again)) == [(0, 29)]


def test_steps_with_no_calls_seen_join_their_loop():
    steps = [_step(i, *TRAIN) if i % 3 else _step(i) for i in range(12)] + [_step(i, *OTHER) for i in range(12, 24)]
    assert _spans(loops(steps)) == [(0, 11), (12, 23)]
