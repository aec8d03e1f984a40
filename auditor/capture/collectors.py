"""Collectors: optional evidence gatherers that ride along with every step in the child process.

A collector is installed before the target is imported, is told when each step begins and ends,
and returns plain data that the parent stores in the field named after the collector:
`StepRecord.<name>` (per step) and `Evidence.<name>` (at the end), converted to the field's type.
Add one by listing it in COLLECTORS under its name and giving StepRecord/Evidence
(auditor.evidence.model) the fields of that name.
"""
from __future__ import annotations

import importlib
from typing import Any, Protocol


class Collector(Protocol):
    name: str

    def install(self) -> None: ...

    def step_begin(self, index: int) -> None: ...

    def step_end(self, index: int) -> dict[str, Any] | None: ...

    def finish(self) -> dict[str, Any] | None: ...


# name (the evidence fields it fills) -> "module:class"
COLLECTORS: dict[str, str] = {"numerics": "auditor.capture.numerics.collector:Numerics",
                              "distributed": "auditor.capture.probes.dist:DistProbes",
                              "weights": "auditor.capture.weights:Weights"}


def load_collectors(skip: tuple[str, ...] = ()) -> list[Collector]:
    """The collectors, but those named in `skip` (not even imported: they cost nothing)."""
    out = []
    for name, spec in COLLECTORS.items():
        if name in skip:
            continue
        module, _, attr = spec.partition(":")
        out.append(getattr(importlib.import_module(module), attr)())
    return out
