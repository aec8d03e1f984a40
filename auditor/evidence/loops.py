"""The training loops a run's steps came from. A program that trains one model and then another,
each in a loop of its own (pytorch/tutorials' nn_tutorial: a logistic regression, then CNNs; its
knowledge distillation tutorial: a teacher, a student, then the student again beside the teacher),
has steps of different work: a median over all of them is no loop's step, and a step of one loop
compared with a step of another measures the loops, not the audit."""
from __future__ import annotations

from collections import Counter
from statistics import median
from typing import Iterable

from auditor.evidence import model as m

_LOOP_KINDS = frozenset((m.FORWARD, m.BACKWARD, m.OPTIMIZER))

# A stretch of fewer steps than this between two boundaries (a first step that also ran a model
# summary's forward, a last one cut short) is part of the loop beside it, not a loop of its own.
MIN_LOOP = 4


def loop_key(step: m.StepRecord) -> frozenset:
    """What a step ran, as its loop's code: its outermost modules' classes and the lines of its
    forward, backward and optimizer calls."""
    return frozenset((t.kind, t.what, t.where.file if t.where else None, t.where.line if t.where else None)
                     for t in step.tallies if t.kind in _LOOP_KINDS)


def loops(steps: list[m.StepRecord]) -> list[list[m.StepRecord]]:
    """`steps` (in order) split into loops: a loop ends where no step after it ran any code
    (loop_key) that a step of it ran. Steps of varying code within one loop (an evaluation every k
    steps, a first step that also ran something else) share code with steps on both sides of them,
    so they split nothing; a step with no forward, backward or optimizer call seen joins its
    neighbours. Stretches shorter than MIN_LOOP join the loop before them (the first, the one
    after it)."""
    keys = [loop_key(s) for s in steps]
    after = Counter(k for k in keys if k)
    before: set[frozenset] = set()
    shared = 0  # keys run both before the step and at or after it
    cuts = []
    for i, k in enumerate(keys):
        if i and not shared and k:
            cuts.append(i)
        if not k:
            continue
        after[k] -= 1
        if k not in before:
            before.add(k)
            shared += after[k] > 0
        elif after[k] == 0:
            shared -= 1
    edges = [0, *cuts, len(steps)]
    parts = [steps[a:b] for a, b in zip(edges, edges[1:]) if b > a]
    merged: list[list[m.StepRecord]] = []
    for part in parts:
        if merged and (len(part) < MIN_LOOP or len(merged[-1]) < MIN_LOOP):
            merged[-1] = merged[-1] + part
        else:
            merged.append(part)
    if len(merged) > 1 and len(merged[-1]) < MIN_LOOP:
        merged[-2:] = [merged[-2] + merged[-1]]
    return merged or [steps]


def medians(parts: list[list[m.StepRecord]], basis: Iterable[m.StepRecord]) -> list[float | None]:
    """Each loop's median step time (StepRecord.time_ms) over the steps of `basis` in it (the
    reports' median basis: the timed steps), None where it has none."""
    ids = {s.index for s in basis}
    out: list[float | None] = []
    for part in parts:
        times = [s.time_ms for s in part if s.index in ids]
        out.append(median(times) if times else None)
    return out
