"""What a profiler trace was recorded without, read from the trace itself: operators' input shapes
(torch.profiler's record_shapes) and Python frames (with_stack), which some rules read (Rule.reads).

A trace recorded by the auditor's window after it dropped them (auditor.capture.window_memory), or
by a user's own torch.profiler run with record_shapes=False / with_stack=False, holds neither, and a
rule that reads them judges it without them. Read, in this order:

- the header: recent torch writes `"record_shapes": 1` / `"with_stack": 1` beside `traceEvents`
  when the option was on, and nothing when it was off; a key set says the option was on;
- the events: with shapes, operators carry `Input Dims` / `Input type` (an argument record with
  inputs: Trace.arg_records); with stacks, the Python tracer's `python_function` events (the old
  schema: operators' `Call stack`).

An option is said to be missing only where the trace has operators to carry it and none does: a
trace with no operators (a GPU-only recording) is said to lack nothing. A trace reduced to a sketch
(auditor.evidence.ranks.sketch: some of its rows only) is not judged; its rules ran on the whole.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from auditor.evidence.trace.decode import CAT

# torch.profiler's options a rule may read (Rule.reads), in the order a note names them
OPTIONS = ("record_shapes", "with_stack")


def recorded_without(trace: Any) -> tuple[str, ...]:
    """The OPTIONS the parsed trace was recorded without (empty: it has both, or cannot tell)."""
    cached = trace.__dict__.get("_recorded_without")
    if cached is None:
        cached = trace.__dict__["_recorded_without"] = _without(trace)
    return cached


def _without(trace: Any) -> tuple[str, ...]:
    if getattr(trace, "sketch", None) is not None:
        return ()
    events = trace.events
    if not len(events):
        return ()
    cat = trace.col("cat")
    ops = cat == CAT["cpu_op"]
    if not ops.any():
        return ()
    meta = trace.metadata
    out: list[str] = []
    if not meta.get("record_shapes") and not _has_shapes(trace, ops):
        out.append("record_shapes")
    if not meta.get("with_stack") and not trace.has_stacks:
        out.append("with_stack")
    return tuple(out)


def _has_shapes(trace: Any, ops: np.ndarray) -> bool:
    """An operator carries an argument record with inputs (dims or types: the profiler writes both
    with shapes, neither without)."""
    if "args" not in trace.events:
        return False
    codes = np.unique(trace.col("args")[ops])
    records = trace.arg_records
    return any(0 <= c < len(records) and (records[c].dims or records[c].types) for c in codes.tolist())

