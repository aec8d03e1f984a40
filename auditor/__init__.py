"""auditor: a PyTorch training-performance auditor.

The pipeline is the architecture: capture -> evidence -> rules -> reports. Layers import downward
only: evidence imports none of the others; capture and rules import evidence and the top-level
findings, fixes and config modules; reports import evidence, findings, fixes and the rule registry
(for the rules' docs).

From Python (docs/python.md): `auditor.analyze`, `auditor.run` and `auditor.load` return an
`auditor.Audit`, imported when first used (the audited program imports auditor: it stays light).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from auditor.errors import AuditError
from auditor.step_marker import step

if TYPE_CHECKING:
    from auditor.api import analyze, compare, load, run
    from auditor.audit import Audit

__version__ = "0.1.0"
__all__ = ["step", "analyze", "run", "load", "compare", "Audit", "AuditError", "__version__"]

_LAZY = {"analyze": "auditor.api", "run": "auditor.api", "load": "auditor.api", "compare": "auditor.api",
         "Audit": "auditor.audit"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'auditor' has no attribute {name!r}")
