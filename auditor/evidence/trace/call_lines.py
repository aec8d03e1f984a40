"""The line of a call inside a function, where a trace names only the function's `def` line.

torch's Python tracer names each Python frame by its function's first line (`demo.py(38): step`),
and the event below it by what was called (`<built-in method to of Tensor object at 0x...>`, a
Python function's `dataloader.py(..): __next__`, an `aten::` op). When the function's source is
here and exactly one line of its body calls that name, that line is where the work was done."""
from __future__ import annotations

import ast
import re
from functools import lru_cache

from auditor.evidence.frame import Frame
from auditor.evidence.recorded_frames import parse_frame
from auditor.evidence import source_access

_BUILTIN = re.compile(r"^<built-in (?:method|function) (\w+)")
# a special method is reached through the builtin or syntax that calls it
_SPECIAL = {"__next__": "next", "__iter__": "iter", "__len__": "len"}


def callee_name(event_name: str) -> str | None:
    """What the event below a frame called: a builtin's or Python function's name, an op's name
    without its namespace (`aten::to` -> `to`); None when it names nothing callable."""
    m = _BUILTIN.match(event_name)
    if m:
        name = m.group(1)
    elif (f := parse_frame(event_name)) is not None:
        name = f.function
    elif "::" in event_name:
        name = event_name.rsplit("::", 1)[1]
    else:
        return None
    name = _SPECIAL.get(name, name)
    return name if name.isidentifier() and not name.startswith("__") else None


def _functions(file: str) -> tuple[tuple[int, int, tuple[tuple[str, int], ...]], ...]:
    """Each function of `file`: (def line, last line, ((called name, line), ...) of its own body,
    nested functions' bodies left out). Empty when the file cannot be read or parsed here. (Cached
    by the source's text: a relative name is found from the working directory and sys.path.)"""
    return _parsed("".join(source_access.getlines(file)))


@lru_cache(maxsize=256)
def _parsed(text: str) -> tuple[tuple[int, int, tuple[tuple[str, int], ...]], ...]:
    if not text:
        return ()
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return ()
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        calls: list[tuple[str, int]] = []
        todo = list(fn.body)
        while todo:
            node = todo.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                continue
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
                if name:
                    calls.append((name, node.lineno))
            todo.extend(ast.iter_child_nodes(node))
        out.append((fn.lineno, fn.end_lineno or fn.lineno, tuple(calls)))
    return tuple(out)


def call_line(frame: Frame, callee: str | None) -> Frame:
    """`frame` at the one line of its function's body that calls `callee`, when the frame names
    its function's `def` line, its source is here and exactly one line calls that name; else
    `frame` itself (its Location then says the trace records the function, not the line)."""
    if not callee or not frame.file:
        return frame
    code = source_access.getline(frame.file, frame.line).lstrip()
    if not code.startswith(("def ", "async def ")):
        return frame
    for start, _end, calls in _functions(frame.file):
        if start == frame.line:
            lines = {line for name, line in calls if name == callee}
            if len(lines) == 1:
                return Frame(file=frame.file, line=lines.pop(), function=frame.function)
            return frame
    return frame

