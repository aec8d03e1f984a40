"""Code fixes: small source edits derived from the user's file, rendered as a `git apply`-able diff.

Rules build `Edit`s with these helpers; the patch reporter joins every finding's edits per file.
All edits are computed from the file as it is on disk at analysis time; when the file is gone or
the line no longer matches what the run saw, no edit is offered.
"""
from __future__ import annotations

import ast
import difflib
import os
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Iterable

from auditor.rules.base import Edit


def read_lines(file: str) -> list[str] | None:
    try:
        return Path(file).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _statement_at(file: str, line: int) -> ast.stmt | None:
    """The innermost simple statement starting on `line`."""
    lines = read_lines(file)
    if lines is None:
        return None
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError:
        return None
    best = None
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and node.lineno == line and not hasattr(node, "body"):
            best = node
    return best


def remove_statement(file: str, line: int, reason: str) -> Edit | None:
    """Replace the statement on `line` with `pass  # reason` (keeps blocks syntactically valid)."""
    stmt = _statement_at(file, line)
    lines = read_lines(file)
    if stmt is None or lines is None or not isinstance(stmt, ast.Expr):
        return None
    end = stmt.end_lineno or line
    return Edit(file=file, start=line, end=end, lines=[f"{_indent(lines[line - 1])}pass  # {reason}"])


def _call_on_line(file: str, line: int, names: Iterable[str]) -> ast.Call | None:
    lines = read_lines(file)
    if lines is None:
        return None
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError:
        return None
    wanted = set(names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.lineno <= line <= (node.end_lineno or node.lineno):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in wanted:
                return node
    return None


def edit_call_kwargs(file: str, line: int, names: Iterable[str], set_kwargs: dict[str, str] | None = None,
                     drop: Iterable[str] = ()) -> Edit | None:
    """Rewrite the call to one of `names` spanning `line`: set keyword arguments (values are source
    text) and drop others. Works on single- and multi-line calls by regenerating the call's text."""
    call = _call_on_line(file, line, names)
    lines = read_lines(file)
    if call is None or lines is None:
        return None
    drop = set(drop)
    set_kwargs = dict(set_kwargs or {})
    src = "\n".join(lines)
    offsets = [0]
    for ln in lines:
        offsets.append(offsets[-1] + len(ln) + 1)

    def pos(lineno: int, col: int) -> int:
        # ast columns are UTF-8 byte offsets
        return offsets[lineno - 1] + len(lines[lineno - 1].encode()[:col].decode())

    def seg(node: ast.AST) -> str:
        return src[pos(node.lineno, node.col_offset):pos(node.end_lineno, node.end_col_offset)]

    parts = [seg(a) for a in call.args]
    changed = False
    for kw in call.keywords:
        if kw.arg in drop:
            changed = True
            continue
        if kw.arg in set_kwargs:
            value = set_kwargs.pop(kw.arg)
            changed |= seg(kw.value) != value
            parts.append(f"{kw.arg}={value}")
        else:
            parts.append(seg(kw))
    for k, v in set_kwargs.items():
        parts.append(f"{k}={v}")
        changed = True
    if not changed:
        return None
    start, end = call.lineno, call.end_lineno or call.lineno
    head = src[offsets[start - 1]:pos(call.lineno, call.col_offset)]
    tail = src[pos(call.end_lineno, call.end_col_offset):offsets[end] - 1]
    new_call = f"{seg(call.func)}({', '.join(parts)})"
    return Edit(file=file, start=start, end=end, lines=(head + new_call + tail).split("\n"))


def replace_in_line(file: str, line: int, old: str, new: str) -> Edit | None:
    lines = read_lines(file)
    if lines is None or line > len(lines) or old not in lines[line - 1]:
        return None
    return Edit(file=file, start=line, end=line, lines=[lines[line - 1].replace(old, new, 1)])


@lru_cache(maxsize=256)
def _git_root(directory: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", directory, "rev-parse", "--show-toplevel"],
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def patch_path(file: str) -> str:
    """The path a patch names: relative to the file's git work tree, else to the current dir."""
    absolute = os.path.realpath(file)
    root = _git_root(os.path.dirname(absolute))
    base = os.path.realpath(root) if root else os.getcwd()
    rel = os.path.relpath(absolute, base)
    return rel if not rel.startswith("..") else absolute.lstrip("/")


def apply_edits(lines: list[str], edits: list[Edit]) -> list[str]:
    """Apply non-overlapping edits bottom-up; an edit overlapping one already applied is skipped."""
    out = list(lines)
    taken: list[tuple[int, int]] = []
    for e in sorted(edits, key=lambda e: (e.start, e.end), reverse=True):
        if any(not (e.end < s or e.start > t) for s, t in taken):
            continue
        out[e.start - 1:e.end] = e.lines
        taken.append((e.start, e.end))
    return out


def unified_diff(edits: Iterable[Edit]) -> str:
    """One diff for all edits, grouped per file, with a/ b/ prefixes for `git apply`."""
    by_file: dict[str, list[Edit]] = {}
    for e in edits:
        by_file.setdefault(e.file, []).append(e)
    chunks = []
    for file in sorted(by_file):
        lines = read_lines(file)
        if lines is None:
            continue
        new = apply_edits(lines, by_file[file])
        name = patch_path(file)
        diff = difflib.unified_diff([ln + "\n" for ln in lines], [ln + "\n" for ln in new],
                                    fromfile=f"a/{name}", tofile=f"b/{name}", n=3)
        chunks.append("".join(diff))
    return "".join(chunks)
