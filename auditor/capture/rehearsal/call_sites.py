"""Where a rehearsed call was made: the user's frame and the line of the call it is running."""
from __future__ import annotations

import ast
import linecache
import os
from types import CodeType, FrameType

from auditor.capture.frames import call_position, is_torch_internal, library_code

_call_lines: dict[tuple[CodeType, int], int] = {}  # (code, f_lasti) -> line of the call running there
_method_names: dict[str, dict[tuple[int, int, int, int], int]] = {}  # file -> call's span -> its name's line
# the audit child's modules that run the program (a script's module code, a step function called N
# times): no frame above theirs is the user's, so a caller's walk up the stack ends at them
_CAPTURE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RUNNERS = frozenset(os.path.join(_CAPTURE, name) for name in ("program.py", "child.py"))


def call_site(frame: FrameType | None) -> tuple[str, int, str] | None:
    """`frames.user_frame(frame)` (the first user frame at or above `frame`, else the first frame
    outside torch and the auditor), named at the line of the call that frame is running. Python
    places a frame's current line (`f_lineno`) at the start of the running instruction's source
    span; for a method call compiled as a plain call -- `.to(**kwargs)`, `.to(*args)` on a
    receiver that starts a line above -- that span is the whole call expression, which starts
    with its receiver, so f_lineno names the statement's first line, not the line of `.to(...)`."""
    f, _ = _site_frame(frame)
    return None if f is None else (f.f_code.co_filename, _call_line(f), f.f_code.co_name)


def call_site_and_caller(frame: FrameType | None) -> tuple[tuple[str, int, str] | None, tuple[str, int] | None]:
    """`call_site(frame)`, and where the user's code called the function of that site's frame when
    it is the user's: the next user frame up (torch's and other libraries' frames between, such as
    nn.Module.__call__, skipped), at the line of its call; None when no user frame calls it. A
    forward called once per token of a loop has its calls' launches tied to that loop. One walk up
    the stack for both (a rehearsed launch asks for both)."""
    f, user = _site_frame(frame)
    if f is None:
        return None, None
    site = f.f_code.co_filename, _call_line(f), f.f_code.co_name
    if not user:
        return site, None
    # (the numerics mode calls an op through a relay compiled under the user's file, function name
    # and line: the user's frame it relays for is at that same place)
    own = (f.f_code.co_filename, f.f_code.co_name, f.f_lineno)
    f = f.f_back
    while f is not None:
        code = f.f_code
        if code.co_filename in _RUNNERS:
            break
        if not library_code(code) and (code.co_filename, code.co_name, f.f_lineno) != own:
            return site, (code.co_filename, _call_line(f))
        f = f.f_back
    return site, None


def _site_frame(frame: FrameType | None) -> tuple[FrameType | None, bool]:
    """The frame `call_site` names, and whether it is the user's (else the first frame outside torch
    and the auditor, or None)."""
    f, fallback = frame, None
    while f is not None:
        code = f.f_code
        if not library_code(code):
            return f, True
        if fallback is None and not is_torch_internal(code.co_filename):
            fallback = f
        f = f.f_back
    return fallback, False


def _call_line(f: FrameType) -> int:
    key = (f.f_code, f.f_lasti)
    line = _call_lines.get(key)
    if line is None:
        line = _call_lines[key] = _method_name_line(f.f_code, f.f_lasti) or f.f_lineno
    return line


def _method_name_line(code: CodeType, lasti: int) -> int | None:
    """The line of the method's name when the instruction at `lasti` (a byte offset) is a method
    call spanning lines: its exact source span (`co_positions`, Python 3.11+) is matched with the
    call in the file's syntax tree. None when f_lineno is already right (one-line spans, calls
    Python compiled as method calls: their span starts at the method's name) or cannot be known."""
    span = call_position(code, lasti)
    if span is None or span[0] == span[1]:
        return None
    start, end, col, end_col = span
    return _method_calls(code.co_filename).get((start, col, end, end_col))


def _method_calls(filename: str) -> dict[tuple[int, int, int, int], int]:
    """Method calls of a file that span lines: (line, col, end line, end col) -> the name's line."""
    calls = _method_names.get(filename)
    if calls is None:
        calls = _method_names[filename] = {}
        try:
            tree = ast.parse("".join(linecache.getlines(filename)))
        except (SyntaxError, ValueError):
            return calls
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.end_lineno is not None and node.lineno != node.end_lineno):
                key = (node.lineno, node.col_offset, node.end_lineno, node.end_col_offset or 0)
                calls[key] = node.func.end_lineno or node.lineno
    return calls
