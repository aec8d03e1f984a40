"""The primary rank's trace as the driver of a job of ranks holds it: a TraceSketch, what the reports
and the loader read of a parsed trace (its header, steps, `[memory]` events, the span of its work,
its operator table), made where the trace is read (auditor.evidence.ranks.summary.reduce_trace)
and turned back into a Trace (SketchTrace) in the driver.

Why: the driver of `audit analyze` on a job's ranks holds the ranks' summaries and nothing that
grows with a trace's events, so that a job of 1 GB traces needs no more memory there than one of
1 MB traces. The rules that read the primary rank's events run where its full trace is parsed again
(auditor.rules.primary): a SketchTrace is never given to a rule.

What a sketch keeps of the events: every `[memory]` row (the memory plot and the recorded peak;
only a trace recorded with profile_memory=True has them), the row that starts first and the row
that ends last among host and GPU work (Trace.window of a trace without steps), and one GPU row
when there is GPU work (which trace the GPU plots describe). Everything else the reports read is
computed from the full trace and kept: the operator table (top_ops, without the auditor's own
ranges) and, set by the rules' run, the efficiency table (auditor.evidence.trace.efficiency).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from auditor.evidence.trace.decode import CAT, CPU_NESTING, GPU_WORK, SymbolTable
from auditor.evidence.trace.model import Trace

if TYPE_CHECKING:  # (pandas is imported where a trace is read: an audit without one never pays for it)
    import pandas as pd

TOP_OPS = 50  # operators a sketch keeps (the report shows 20)


class TraceSketch(msgspec.Struct):
    """One parsed trace reduced to what the driver's reports and loader read (see the module).

    path, label, metadata (its header: deviceProperties, distributedInfo...), processes, schema,
    dropped, steps_from: as the Trace has them; events: how many timed events the trace held;
    steps: Trace.steps by column; rows: the events kept (the module says which), by column of
    Trace.events, with dtypes their numpy dtypes; names: the names of the kept rows (their `name`
    codes index it); top_ops: Trace.top_ops of the program's operators (without the auditor's
    own ranges), the first TOP_OPS."""

    path: str
    label: str
    metadata: dict[str, Any]
    events: int
    steps: dict[str, list[float]]
    rows: dict[str, list[float]]
    dtypes: dict[str, str]
    names: list[str]
    top_ops: list[dict[str, Any]] = []
    processes: dict[int, dict[str, Any]] = {}
    schema: str = "new"
    dropped: str = ""
    steps_from: str | None = None


class SketchTrace(Trace):
    """A Trace made from a TraceSketch: its events are the sketch's kept rows, its operator table the
    sketch's. Reports read it as a Trace; rules never do (auditor.rules.primary)."""

    sketch: TraceSketch | None = None

    def top_ops(self, limit: int = 20, exclude: np.ndarray | None = None,
                also_nested: np.ndarray | None = None) -> list[dict[str, Any]]:
        return [dict(r) for r in (self.sketch.top_ops if self.sketch else [])[:limit]]

    def auditor_ranges(self) -> np.ndarray:
        return np.empty(0, dtype=np.int64)  # (already left out of the sketch's top_ops)


def _kept_rows(trace: Trace) -> np.ndarray:
    cat = trace.col("cat")
    keep = cat == CAT["memory"]
    work = np.flatnonzero(np.isin(cat, CPU_NESTING + GPU_WORK))
    if len(work):
        keep[work[np.argmin(trace.col("ts")[work])]] = True
        keep[work[np.argmax(trace.col("end")[work])]] = True
    gpu = np.flatnonzero(np.isin(cat, GPU_WORK) & ~trace.col("instant"))
    if len(gpu):
        keep[gpu[0]] = True
    return np.flatnonzero(keep)


def sketch_trace(trace: Trace) -> TraceSketch:
    """The sketch of a parsed trace."""
    rows = _kept_rows(trace)
    part = trace.events.iloc[rows]
    codes = part["name"].to_numpy()
    distinct = sorted({int(c) for c in codes if c >= 0})
    remap = {c: i for i, c in enumerate(distinct)}
    columns = {c: part[c].to_numpy().tolist() for c in part.columns}
    columns["name"] = [remap.get(int(c), -1) for c in codes]
    ranges = trace.auditor_ranges()
    ops = trace.top_ops(TOP_OPS) if not len(ranges) else trace.top_ops(TOP_OPS, exclude=trace.auditor_rows(),
                                                                      also_nested=ranges)
    return TraceSketch(path=str(trace.path), label=trace.label, metadata=trace.metadata, events=len(trace.events),
                       steps={c: trace.steps[c].to_numpy().tolist() for c in trace.steps.columns},
                       rows=columns, dtypes={c: str(part[c].dtype) for c in part.columns},
                       names=[trace.symbols[c] for c in distinct], top_ops=ops, processes=trace.processes,
                       schema=trace.schema, dropped=trace.dropped, steps_from=trace.steps_from)


def sketched(sketch: TraceSketch) -> SketchTrace:
    """The SketchTrace of a sketch, for the reports."""
    import pandas as pd
    symbols = SymbolTable()
    symbols.intern_many(list(sketch.names))
    events = pd.DataFrame({c: np.asarray(v, dtype=sketch.dtypes[c]) for c, v in sketch.rows.items()})
    steps = pd.DataFrame({c: np.asarray(v, dtype=np.int64 if c in ("step", "row") else np.float64)
                          for c, v in sketch.steps.items()})
    t = SketchTrace(path=Path(sketch.path), metadata=sketch.metadata, events=events, flows=pd.DataFrame(),
                    symbols=symbols, processes=dict(sketch.processes), schema=sketch.schema, dropped=sketch.dropped,
                    label=sketch.label, steps=steps, steps_from=sketch.steps_from)
    t.sketch = sketch
    return t
