"""A place in the user's code (Frame), as every evidence record that points at code names it."""
from __future__ import annotations

from typing import Any

import msgspec

from auditor.evidence import source_access


class Frame(msgspec.Struct, frozen=True):
    """A place in the user's code: the first frame outside torch and the auditor."""

    file: str
    line: int
    function: str = ""
    code: str = ""


def recorded_frame(where: Any) -> Frame | None:
    """The Frame of a place a recorder named (a dict {"file", "line", "function"}, or a Frame
    without its code), with its source line read now; None when it names no file."""
    if isinstance(where, msgspec.Struct):  # a Frame, or a recorder's call site (file, line, function)
        file, line, function = where.file, where.line, where.function
    elif where:
        file, line, function = where.get("file"), where.get("line"), where.get("function")
    else:
        return None
    if not file:
        return None
    return Frame(file=file, line=int(line), function=function or "", code=source_access.getline(file, int(line)).strip())
