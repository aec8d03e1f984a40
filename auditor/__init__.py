"""auditor: a PyTorch training-performance auditor.

The pipeline is the architecture: capture -> evidence -> rules -> reports. Layers import downward
only: evidence imports none of the others; capture and rules import evidence and the top-level
findings, fixes and config modules; reports import evidence, findings, fixes and the rule registry
(for the rules' docs).

From Python (docs/python.md): `auditor.analyze`, `auditor.run` and `auditor.load` return an
`auditor.Audit`; errors raise `auditor.AuditError`.
"""
from __future__ import annotations

from typing import Any

from auditor.errors import AuditError
from auditor.step_marker import step

__version__ = "0.1.0"
__all__ = ["step", "analyze", "run", "load", "compare", "Audit", "AuditError", "__version__"]


def __getattr__(name: str) -> Any:
    """The Python API (auditor.api), imported on first use (PEP 562): pandas and the pipelines are
    not imported with auditor, which the audited program imports."""
    if name in ("analyze", "run", "load", "compare", "Audit"):
        import importlib

        return getattr(importlib.import_module("auditor.api"), name)
    raise AttributeError(f"module 'auditor' has no attribute {name!r}")
