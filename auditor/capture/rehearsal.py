"""CUDA rehearsal on the CPU (issue 4): run code written for a GPU on a machine without one.

`install(mode, source)` is called first thing in the child process. It returns None when no
rehearsal happens, else a dict describing it (with a "note" for the report's environment section).
"""
from __future__ import annotations

from typing import Any

import torch


def install(mode: str, source: str | None) -> dict[str, Any] | None:
    if mode == "off" or torch.cuda.is_available():
        return None
    return None  # rehearsal itself is being built (issue 4); until then, stand-ins answer torch.cuda
