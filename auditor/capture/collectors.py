"""Collectors: optional evidence gatherers that ride along with every step in the child process.

A collector is installed before the target is imported, is told when each step begins and ends,
and returns plain data that the parent stores in the field `name` of StepRecord (per step) and
Evidence (at the end), converted to that field's type, or in their `extra[name]` when they have no
such field. Add one by listing it in COLLECTORS.
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


COLLECTORS: tuple[str, ...] = ("auditor.capture.numerics:Numerics", "auditor.capture.probes.dist:DistProbes")


def load_collectors(skip: tuple[str, ...] = ()) -> list[Collector]:
    """The collectors, but those named in `skip` (not even imported: they cost nothing)."""
    out = []
    for spec in COLLECTORS:
        module, _, attr = spec.partition(":")
        if module.rpartition(".")[2] in skip:
            continue
        out.append(getattr(importlib.import_module(module), attr)())
    return out
