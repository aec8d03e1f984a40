"""The edit that replaces a hand-written causal attention with F.scaled_dot_product_attention, where
the code has the shape every GPT tutorial gives it: consecutive assignments to one name

    att = (q @ k.transpose(-2, -1)) * SCALE            # or / DIVISOR, or no scale
    att = att.masked_fill(MASK == 0, float("-inf"))    # MASK made by torch.tril in the same file
    att = torch.softmax(att, dim=-1)                   # F.softmax(att, dim=-1), att.softmax(dim=-1)
    att = self.DROPOUT(att)                            # optional: an nn.Dropout module
    y = att @ v

become one statement, `y = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=...,
is_causal=True, scale=SCALE)`: the same attention up to rounding (dropout draws other masks). Any
other shape (a mask that is not causal, an additive bias, a softmax over another dim) gets no edit."""
from __future__ import annotations


import libcst as cst
import libcst.matchers as m
from libcst.metadata import MetadataWrapper, PositionProvider

from auditor.evidence.frame import Frame
from auditor.evidence.trace.model import enclosing_def_line
from auditor.findings import Edit
from auditor.evidence import source_access

_SDPA = "torch.nn.functional.scaled_dot_product_attention"


def _code(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node)


def _assign(stmt: cst.CSTNode) -> tuple[str, cst.BaseExpression] | None:
    """(target name, value) of `name = value` on a line of its own."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return None
    a = stmt.body[0]
    if not isinstance(a, cst.Assign) or len(a.targets) != 1 or not isinstance(a.targets[0].target, cst.Name):
        return None
    return a.targets[0].target.value, a.value


def _unparen(e: cst.BaseExpression) -> cst.BaseExpression:
    return e.with_changes(lpar=[], rpar=[]) if getattr(e, "lpar", None) else e


def _matmul(e: cst.BaseExpression) -> tuple[cst.BaseExpression, cst.BaseExpression] | None:
    e = _unparen(e)
    if isinstance(e, cst.BinaryOperation) and isinstance(e.operator, cst.MatrixMultiply):
        return e.left, e.right
    if m.matches(e, m.Call(func=m.Attribute(value=m.Name("torch"), attr=m.Name("matmul")))) and len(e.args) == 2:
        return e.args[0].value, e.args[1].value
    return None


def _scores(e: cst.BaseExpression) -> tuple[str, str, str | None] | None:
    """(q, k, scale) of `(q @ k.transpose(-2, -1)) [* s | / d]`; scale None: SDPA's default is wrong."""
    e = _unparen(e)
    scale: str | None = "1.0"
    if isinstance(e, cst.BinaryOperation) and isinstance(e.operator, (cst.Multiply, cst.Divide)):
        mm = _matmul(e.left)
        scale = _code(e.right) if isinstance(e.operator, cst.Multiply) else f"1.0 / ({_code(e.right)})"
    else:
        mm = _matmul(e)
    if mm is None:
        return None
    q, kt = mm
    if not (isinstance(q, cst.Name) and m.matches(kt, m.Call(func=m.Attribute(value=m.Name(), attr=m.Name("transpose")),
                                                             args=[m.Arg(), m.Arg()]))):
        return None
    dims = [_code(a.value).replace(" ", "") for a in kt.args]
    if dims not in (["-2", "-1"], ["-1", "-2"]):
        return None
    return q.value, kt.func.value.value, scale


def _softmax_of(e: cst.BaseExpression, name: str) -> bool:
    last_dim = m.Arg(keyword=m.Name("dim"), value=m.UnaryOperation(operator=m.Minus(), expression=m.Integer("1")))
    return (m.matches(e, m.Call(func=m.Attribute(value=m.Name("torch") | m.Name("F"), attr=m.Name("softmax")),
                                args=[m.Arg(value=m.Name(name), keyword=None), last_dim]))
            or m.matches(e, m.Call(func=m.Attribute(value=m.Name(name), attr=m.Name("softmax")), args=[last_dim])))


def _causal_fill(e: cst.BaseExpression, name: str) -> bool:
    """`name.masked_fill(MASK == 0, float("-inf"))`."""
    return m.matches(e, m.Call(
        func=m.Attribute(value=m.Name(name), attr=m.Name("masked_fill")),
        args=[m.Arg(value=m.Comparison(comparisons=[m.ComparisonTarget(operator=m.Equal(), comparator=m.Integer("0"))])),
              m.Arg(value=m.Call(func=m.Name("float"), args=[m.Arg(value=m.SimpleString('"-inf"')
                                                                   | m.SimpleString("'-inf'"))]))]))


def _edit_in(body: list[cst.CSTNode], positions, text: str, file: str) -> Edit | None:
    for i in range(len(body)):
        first = _assign(body[i])
        got = _scores(first[1]) if first else None
        if got is None:
            continue
        name, (q, k, scale) = first[0], got
        j = i + 1
        fill = _assign(body[j]) if j < len(body) else None
        if not (fill and fill[0] == name and _causal_fill(fill[1], name)):
            continue
        j += 1
        soft = _assign(body[j]) if j < len(body) else None
        if not (soft and soft[0] == name and _softmax_of(soft[1], name)):
            continue
        j += 1
        dropout = "0.0"
        drop = _assign(body[j]) if j < len(body) else None
        if drop and drop[0] == name and m.matches(drop[1], m.Call(func=m.Attribute(value=m.Name("self")),
                                                                  args=[m.Arg(value=m.Name(name))])):
            dropout = f"{_code(drop[1].func)}.p if self.training else 0.0"
            j += 1
        last = _assign(body[j]) if j < len(body) else None
        mm = _matmul(last[1]) if last else None
        if not (mm and isinstance(mm[0], cst.Name) and mm[0].value == name and isinstance(mm[1], cst.Name)):
            continue
        start, end = positions[body[i]].start.line, positions[body[j]].end.line
        indent = text.splitlines()[start - 1][:len(text.splitlines()[start - 1]) - len(text.splitlines()[start - 1].lstrip())]
        args = [q, k, mm[1].value, f"dropout_p={dropout}", "is_causal=True"]
        if scale is not None:
            args.append(f"scale={scale}")
        return Edit(file=file, start=start, end=end, lines=[f"{indent}{last[0]} = {_SDPA}({', '.join(args)})"])
    return None


def source_lines(frame: Frame) -> tuple[int, int] | None:
    """(first, last) line of the function whose def line `frame` names, when its source is here
    (a torch >= 2 trace names a Python function by its first line)."""
    lines = source_access.getlines(frame.file) if frame.file else []
    if not (0 < frame.line <= len(lines)):
        return None
    if not lines[frame.line - 1].lstrip().startswith(("def ", "async def ")):
        # a frame at a call's line inside the function (Trace.user_frame): its enclosing def
        start = enclosing_def_line(frame)
        if start is None:
            return None
        frame = Frame(file=frame.file, line=start, function=frame.function)
    indent = len(lines[frame.line - 1]) - len(lines[frame.line - 1].lstrip())
    last = frame.line
    for n in range(frame.line + 1, len(lines) + 1):
        text = lines[n - 1]
        if text.strip() and len(text) - len(text.lstrip()) <= indent and not text.lstrip().startswith("#"):
            break
        if text.strip():
            last = n
    return frame.line, last


def sdpa_edit(frame: Frame) -> Edit | None:
    """The edit for the function `frame` names (its def line, as a trace records it), or None. Only
    that function's source is parsed, and only when it holds a masked_fill and a softmax."""
    span = source_lines(frame)
    if span is None:
        return None
    lines = source_access.getlines(frame.file)
    whole = "".join(lines)
    body = lines[span[0] - 1:span[1]]
    indent = len(body[0]) - len(body[0].lstrip())
    text = "".join(line[indent:] if line.strip() else "\n" for line in body)
    if "masked_fill" not in text or "softmax" not in text or "tril" not in whole or "import torch" not in whole:
        return None
    try:
        wrapper = MetadataWrapper(cst.parse_module(text))
    except cst.ParserSyntaxError:
        return None
    positions = wrapper.resolve(PositionProvider)
    for node in wrapper.module.body:
        if isinstance(node, cst.FunctionDef) and isinstance(node.body, cst.IndentedBlock):
            edit = _edit_in(list(node.body.body), positions, text, frame.file)
            if edit is not None:
                shift = span[0] - 1
                return Edit(file=edit.file, start=edit.start + shift, end=edit.end + shift,
                            lines=[" " * indent + line for line in edit.lines])
    return None
