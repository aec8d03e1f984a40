"""The recorder the probes tally into, one per process: per-step tallies by kind, what and the
user's line, and the optimizer steps compiled code ran, recorded once it has run."""
from __future__ import annotations

import os
from typing import Any, Callable

from auditor.capture.probes import graph_use
from auditor.capture.probes.optimizer_updates import _aside
from auditor.capture.unseen import TracedCalls
from auditor.capture.probes.wrappers import _compiling
from auditor.evidence import model as m

FrameKey = tuple[str, int, str] | None


class Recorder:
    """Per-step tallies, shared by every probe. One per process; inert in forked children."""

    def __init__(self, active: bool = True) -> None:
        # False in a forked child (DataLoader workers: their calls are not the step's); every probe
        # reads it first, as an attribute (no getpid, no method call)
        self.active = active
        self.in_data = 0  # > 0 while inside DataLoader iteration
        self.tallies: dict[tuple, dict[str, Any]] = {}
        self.dataloaders: list[dict[str, Any]] = []
        self.retain_events: list[dict[str, Any]] = []  # retain_graph=True backwards of this step
        self.retain_watched: list[dict[str, Any]] = []  # the last step's, unused in it
        self.retain_sampled: dict[FrameKey, int] = {}
        self.retain_alive: dict[FrameKey, int] = {}  # retained graphs alive now, per place
        self.hook_holders: dict[tuple, set[int]] = {}  # HOOK tally -> ids of what it registered on, this step
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self.active = False

    def add(self, kind: str, what: str, where: FrameKey, ms: float = 0.0, **data: Any) -> None:
        key = (kind, what, where, tuple(sorted(data.items())) if data else ())
        t = self.tallies.get(key)
        if t is None:
            self.tallies[key] = {"kind": kind, "what": what, "where": where, "count": 1, "ms": ms, "data": data}
        else:
            t["count"] += 1
            t["ms"] += ms

    def add_sums(self, kind: str, what: str, where: FrameKey, fixed: tuple, **sums: Any) -> None:
        """One more call at `where`, one tally per (kind, what, where, fixed): `fixed` is its
        (name, value) pairs of data that tell tallies apart, `sums` is data added up over the calls."""
        key = (kind, what, where, fixed)
        t = self.tallies.get(key)
        if t is None:
            self.tallies[key] = {"kind": kind, "what": what, "where": where, "count": 1, "ms": 0.0,
                                 "data": {**dict(fixed), **sums}}
        else:
            t["count"] += 1
            data = t["data"]
            for k, v in sums.items():
                data[k] += v

    def hook_added(self, what: str, where: FrameKey, holder: Any, held: int) -> None:
        """A hook registered at `where` on `holder` (a tensor, a module), which holds `held`
        hooks of that kind now: the step's tally keeps the most, and on how many holders."""
        key = (m.HOOK, what, where, ())
        t = self.tallies.get(key)
        if t is None:
            t = self.tallies[key] = {"kind": m.HOOK, "what": what, "where": where, "count": 0, "ms": 0.0,
                                     "data": {"held": 0, "holders": 0}}
        t["count"] += 1
        if held > t["data"]["held"]:
            t["data"]["held"] = held
        ids = self.hook_holders.setdefault(key, set())
        ids.add(id(holder))
        t["data"]["holders"] = len(ids)

    def drain(self, graphs: bool = True) -> list[dict[str, Any]]:
        """Tallies since the last drain, as plain dicts ready to send; finalises retain events.
        A graph unused in its own step is counted unused and watched one step more: if that step's
        backward runs into it, a tensor carried across steps holds it, and it is counted again as
        carried (the rule tells the two apart: dropping retain_graph there breaks the next step)."""
        if NOTED:  # (settle_traced_steps, at a step boundary: never inside a trace)
            settle_traced_steps()
        if _aside[0]:  # (an update that raised skipped its post-hooks: no probe stays aside past its step)
            _aside[:] = [0, False]
        if graphs:  # (False: the graphs freed so far are told at a later drain, a step's or the run's end)
            graph_use.fold(self.add)
        if not (self.tallies or self.retain_events or self.retain_watched or self.hook_holders):
            return []  # (most drains, at every step boundary: nothing below to do)
        for ev in self.retain_watched:
            if ev["used"][0]:
                t = self.tallies.setdefault((m.RETAINED_CARRIED, ev["what"], ev["where"], ()), {
                    "kind": m.RETAINED_CARRIED, "what": ev["what"], "where": ev["where"], "count": 0, "ms": 0.0,
                    "data": {}})
                t["count"] += 1
        self.retain_watched = [ev for ev in self.retain_events if not ev["used"][0]]
        for ev in self.retain_events:
            if ev["used"][0]:
                continue
            # one tally per place; its data keeps the largest graph seen there (only the first
            # few retained graphs per place have their saved bytes measured)
            t = self.tallies.setdefault((m.RETAINED_UNUSED, ev["what"], ev["where"], ()), {
                "kind": m.RETAINED_UNUSED, "what": ev["what"], "where": ev["where"], "count": 0, "ms": 0.0,
                "data": {"graph_nodes": 0, "saved_bytes": 0, "alive_at_once": 0}})
            t["count"] += 1
            t["data"]["graph_nodes"] = max(t["data"]["graph_nodes"], ev["nodes"])
            t["data"]["saved_bytes"] = max(t["data"]["saved_bytes"], ev["saved_bytes"])
            if ev["saved_partial"]:  # (some saved values packed by hooks, not read: a lower bound)
                t["data"]["saved_partial"] = True
            if ev["alive"] is None or t["data"]["alive_at_once"] is None:
                t["data"]["alive_at_once"] = None  # (unknown: every graph counts)
            else:
                t["data"]["alive_at_once"] = max(t["data"]["alive_at_once"], ev["alive"])
        self.retain_events = []
        self.hook_holders = {}
        out = []
        for t in self.tallies.values():
            w = t["where"]
            out.append({**t, "where": {"file": w[0], "line": w[1], "function": w[2]} if w else None})
        self.tallies = {}
        return out


# The process's recorder: inert (not active) until install() (auditor.capture.probes.installation)
REC = Recorder(active=False)


# Optimizer steps that ran inside code torch.compile traced, noted by the traced step pre-hook
_TRACED_STEPS = TracedCalls()
# its notes (empty in a program that compiles no optimizer step): code that cannot be running
# inside a trace tests it before settling, a dict's truth for the ~5 calls a step of two Python
# calls (is_compiling) and the take (settle_noted)
NOTED = _TRACED_STEPS.noted()
_TRACED_STEP_READERS: list[Callable[[Any, FrameKey], None]] = []


def traced_optimizer_step(opt: Any) -> None:
    """What the optimizer pre-hooks do when torch.compile traces them (`torch.compiler.is_compiling()`):
    note the step, as a store dynamo replays after the graph, for `settle_traced_steps` to read
    once the compiled code has run (see unseen.TracedCalls). Run as they are, the hooks would be a
    graph break in the user's compiled step, and an error under `fullgraph=True`."""
    _TRACED_STEPS.note(opt)


def read_traced_steps(reader: Callable[[Any, FrameKey], None]) -> None:
    """Have `reader(optimizer, where)` called with each optimizer step `settle_traced_steps` reads."""
    _TRACED_STEP_READERS.append(reader)


def unread_traced_steps(reader: Callable[[Any, FrameKey], None]) -> None:
    if reader in _TRACED_STEP_READERS:
        _TRACED_STEP_READERS.remove(reader)


def settle_traced_steps() -> None:
    """The optimizer steps that ran in compiled code since the last call, counted as optimizer
    phases of the user's line that called the compiled code, with no time (the hooks that time a
    step cannot run inside a graph), and handed to the readers. Called wherever the auditor runs
    next and the step's inputs may change: before the next optimizer step, zero_grad, a backward
    pass or a scheduler's step, and at the step's end."""
    if _compiling() or not NOTED:  # (read by the code that runs after the compiled code)
        return
    for opt, where in _TRACED_STEPS.take():
        rec = REC
        if rec is not None and rec.active:
            rec.add(m.OPTIMIZER, type(opt).__name__, where, 0.0, compiled=True)
        for reader in _TRACED_STEP_READERS:
            reader(opt, where)
