"""What a graph scan's holder is called in a finding: a global (`preds`), a module's state
(`model.1.rm`), a local of a running function (`total`, a local of `train()`) or a variable a
closure keeps (`seen`, a variable of `watch()` that a closure it made keeps: a hook's list)."""
from __future__ import annotations

import os
from typing import Any

from auditor.findings import Location


def holder_key(h: dict[str, Any]) -> tuple[str, str]:
    """(function, name): a local `total` of `train()` and a global `total` are two holders."""
    return h.get("function") or "", h["name"]


def holder_label(h: dict[str, Any]) -> str:
    """`preds`; `total` (a local of `train()`, at line 25): a local is named with its function and
    the line that grows it, which a reader looks for in that function."""
    name = f"`{h['name']}`"
    if not h.get("function"):
        return name
    w = h.get("where")
    at = f", at {os.path.basename(w['file'])}:{w['line']}" if w else ""
    if h.get("closure"):
        return f"{name} (a variable of `{h['function']}()` that a closure it made keeps{at})"
    return f"{name} (a local of `{h['function']}()`{at})"


def holder_location(h: dict[str, Any]) -> Location | None:
    """The line that fills the holder, when the scan found it."""
    w = h.get("where")
    return Location(file=w["file"], line=w["line"], code=w.get("code", "")) if w else None
