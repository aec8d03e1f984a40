"""A place in the user's code (Frame), as every evidence record that points at code names it."""
from __future__ import annotations

import msgspec


class Frame(msgspec.Struct, frozen=True):
    """A place in the user's code: the first frame outside torch and the auditor."""

    file: str
    line: int
    function: str = ""
    code: str = ""
