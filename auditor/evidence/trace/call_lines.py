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
    without its namespace and marked as an op's (`aten::to` -> `::to`: what can make it is looked
    up in _MADE_BY); None when it names nothing callable."""
    m = _BUILTIN.match(event_name)
    if m:
        name = m.group(1)
    elif (f := parse_frame(event_name)) is not None:
        name = f.function
    elif "::" in event_name:
        name = event_name.rsplit("::", 1)[1]
        return f"::{name}" if name.isidentifier() and not name.startswith("__") else None
    else:
        return None
    name = _SPECIAL.get(name, name)
    return name if name.isidentifier() and not name.startswith("__") else None


# What an op seen directly below a frame (no Python call of its own name above it) can be made by
# in that frame's source: the names of calls, and "?bool" (a tensor's truth taken: `if t:`,
# `while t:`, `assert t`, `bool(t)`), "?scalar" (`float(t)`, `int(t)`, `bool(t)`), "?mask" (a
# subscript by a computed index: `x[y > 0.5]`, `x[mask]`).
_MADE_BY: dict[str, tuple[str, ...]] = {
    "is_nonzero": ("?bool",),
    "item": ("item", "?scalar", "?bool"),
    "_local_scalar_dense": ("item", "tolist", "?scalar", "?bool"),
    "index": ("?mask",),
    "nonzero": ("nonzero", "where", "?mask"),
    "masked_select": ("masked_select", "?mask"),
    "to": ("to", "cuda", "cpu"),
    "_to_copy": ("to", "cuda", "cpu"),
    "copy_": ("copy_", "to", "cuda", "cpu"),
}
MAX_CANDIDATES = 6  # more lines than this that could have made an op name none of them
# an op a comparison operator reaches with no call of its own (`logits[y > 0.5]`: aten::gt)
_COMPARED = {ast.Gt: "?gt", ast.Lt: "?lt", ast.GtE: "?ge", ast.LtE: "?le", ast.Eq: "?eq", ast.NotEq: "?ne"}
_MADE_BY.update({op[1:]: (op,) for op in _COMPARED.values()})


class CandidateFrame(Frame, frozen=True):
    """A frame whose op was made at one of several lines of its function (`lines`, in order; `line`
    is the first): the trace names the function, and its source has more than one line that can
    make that op."""

    lines: tuple[int, ...] = ()


Function = tuple[int, int, tuple[tuple[str, int], ...], tuple[tuple[int, int], ...]]


def _functions(file: str) -> tuple[Function, ...]:
    """Each function of `file`: (def line, last line, ((what it makes, line), ...) of its own body,
    ((first line, last line) of each loop in it), nested functions' bodies left out); the module's
    own code as def line 0. Empty when the file cannot be read or parsed here. (Cached by the
    source's text: a relative name is found from the working directory and sys.path.)"""
    return _parsed("".join(source_access.getlines(file)))


def _makers(body: list[ast.stmt]) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[int, int], ...]]:
    """(what, line) for each call by name and each place a tensor's value could be read (see
    _MADE_BY) in `body`, and the spans of its loops, nested functions and classes left out."""
    out: list[tuple[str, int]] = []
    loops: list[tuple[int, int]] = []
    todo: list[ast.AST] = list(body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            loops.append((node.lineno, node.end_lineno or node.lineno))
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name:
                out.append((name, node.lineno))
            if isinstance(f, ast.Name) and name in ("float", "int", "bool") and node.args:
                out.append(("?scalar", node.lineno))
                if name == "bool":
                    out.append(("?bool", node.lineno))
        elif isinstance(node, (ast.If, ast.While, ast.Assert, ast.IfExp)) and not isinstance(node.test, ast.Constant):
            out.append(("?bool", node.test.lineno))
        elif isinstance(node, ast.Subscript) and isinstance(
                node.slice, (ast.Compare, ast.BoolOp, ast.UnaryOp, ast.Call, ast.Name, ast.Attribute)):
            out.append(("?mask", node.lineno))
        elif isinstance(node, ast.Compare):
            out.extend((_COMPARED[type(op)], node.lineno) for op in node.ops if type(op) in _COMPARED)
        todo.extend(ast.iter_child_nodes(node))
    return tuple(out), tuple(loops)


@lru_cache(maxsize=256)
def _parsed(text: str) -> tuple[Function, ...]:
    if not text:
        return ()
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return ()
    out = [(0, len(text.splitlines()), *_makers(tree.body))]
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append((fn.lineno, fn.end_lineno or fn.lineno, *_makers(fn.body)))
    return tuple(out)


def candidate_lines(file: str, def_line: int, callee: str | None, after: int | None = None) -> list[int] | None:
    """The lines of the function defined at `def_line` (0: the module's own code) that can make
    `callee`, in order; None when the source is not here or names no such function. `after`: the
    line the function was on when the profiler started, for its later work: only the lines it can
    still reach from there (from the outermost loop holding it on, or from the line itself)."""
    if not callee or not file:
        return None
    # a Python-level call is made by calls of its name; an op seen with no call above it, also by
    # what reaches it without one (`if t:` reaches aten::is_nonzero)
    name = callee.removeprefix("::")
    kinds = {name, *(_MADE_BY.get(name, ()) if callee.startswith("::") else ())}
    for start, _end, makers, loops in _functions(file):
        if start == def_line:
            first = 0 if after is None else min([after, *(a for a, b in loops if a <= after <= b)])
            return sorted({line for what, line in makers if what in kinds and line >= first})
    return None


def placed(frame: Frame, lines: list[int] | None) -> Frame | None:
    """`frame` at the one line that can make its op, or as a CandidateFrame naming the few that
    can; None when none can, or too many to name (the caller keeps the frame without a line)."""
    if not lines or len(lines) > MAX_CANDIDATES:
        return None
    if len(lines) == 1:
        return Frame(file=frame.file, line=lines[0], function=frame.function)
    return CandidateFrame(file=frame.file, line=lines[0], function=frame.function, lines=tuple(lines))


def call_line(frame: Frame, callee: str | None) -> Frame:
    """`frame` at the line of its function's body that made `callee` (or at the few that could:
    a CandidateFrame), when the frame names its function's `def` line and its source is here;
    else `frame` itself (its Location then says the trace records the function, not the line)."""
    if not callee or not frame.file:
        return frame
    code = source_access.getline(frame.file, frame.line).lstrip()
    if not code.startswith(("def ", "async def ")):
        return frame
    return placed(frame, candidate_lines(frame.file, frame.line, callee)) or frame


def started_call_line(frame: Frame, def_line: int | None, callee: str | None) -> Frame | None:
    """For a frame that was running when the profiler started (its recorded line is where it was
    then, not where later work was done): the line of its function (`def_line`; 0 for a module's
    own code) that can make `callee`, or the few that can; None when none can."""
    if def_line is None or not frame.file:
        return None
    return placed(frame, candidate_lines(frame.file, def_line, callee, after=frame.line))
