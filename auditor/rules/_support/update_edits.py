"""manual-update's code patch: a loop that updates each parameter by hand made one foreach call.

    for p in model.parameters():                  torch._foreach_add_([p.data for p in model.parameters()],
        p.data.add_(p.grad, alpha=-lr)      ->                        [p.grad for p in model.parameters()], alpha=-lr)

The foreach call does each parameter's arithmetic as the loop did it (the same operation, the same
operands, in the same order; on the CPU it runs the loop's own kernel per tensor), in a few kernel
launches on a GPU instead of one a parameter. Made only where that is known to hold:

- the loop's body is one statement on one line: `P.add_(G)` or `P.sub_(G)`, with or without
  `alpha=A`, or `P -= A * G` / `P -= G * A` (made `_foreach_sub_(Ps, _foreach_mul(Gs, A))`: the
  product rounded first, as the loop rounds it), where P is the loop's name or its `.data` and G
  is its `.grad` (or `.grad.data`), and A does not read the loop's name nor call anything (the foreach call reads it once);
- the loop is `for p in X.parameters():` with nothing else in it (no `else`), so X.parameters() can
  be read once for the parameters and once for their gradients;
- the module imports torch (`import torch`, or `as` another name: that name is used).
Anything else (a momentum buffer, a per-parameter learning rate, several statements) is left to the
advice: an optimizer of torch.optim.
"""
from __future__ import annotations

import ast

from auditor.findings import Edit


def _torch_name(tree: ast.Module) -> str | None:
    """The name the module binds torch to at its top level (`import torch [as t]`)."""
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch":
                    return alias.asname or "torch"
    return None


def _is(node: ast.expr, name: str, *attrs: str) -> bool:
    """Whether `node` is `name.attrs[0].attrs[1]...`."""
    for attr in reversed(attrs):
        if not isinstance(node, ast.Attribute) or node.attr != attr:
            return False
        node = node.value
    return isinstance(node, ast.Name) and node.id == name


def _reads(node: ast.AST, name: str) -> bool:
    """Whether `node` reads `name`, or calls anything (a call's result may change between iterations)."""
    return any(isinstance(n, ast.Name) and n.id == name or isinstance(n, ast.Call) for n in ast.walk(node))


def foreach_update(file: str, line: int) -> Edit | None:
    """The loop whose body is at `line` made one `torch._foreach_*` call (the module's docstring), or
    None where that is not known to compute what the loop computes."""
    from auditor.fixes import parse_file

    parsed = parse_file(file)
    if parsed is None:
        return None
    tree, lines = parsed
    torch = _torch_name(tree)
    loops = [n for n in ast.walk(tree) if isinstance(n, ast.For) and len(n.body) == 1 and not n.orelse
             and n.body[0].lineno == line == n.body[0].end_lineno]
    if torch is None or len(loops) != 1:
        return None
    loop = loops[0]
    body, target, it = loop.body[0], loop.target, loop.iter
    if not (isinstance(target, ast.Name) and isinstance(it, ast.Call) and not it.args and not it.keywords
            and isinstance(it.func, ast.Attribute) and it.func.attr == "parameters"
            and not _reads(it.func.value, target.id)):
        return None
    p = target.id

    def param(node: ast.expr) -> str | None:  # (the loop's name or its .data, as the loop wrote it)
        return ast.unparse(node) if _is(node, p) or _is(node, p, "data") else None

    def grad(node: ast.expr) -> str | None:
        return ast.unparse(node) if _is(node, p, "grad") or _is(node, p, "grad", "data") else None

    src = "\n".join(lines)

    def seg(node: ast.expr) -> str:  # (its text as written; "" where ast cannot give it)
        return ast.get_source_segment(src, node) or ""

    xs = seg(it)
    call = None
    if isinstance(body, ast.Expr) and isinstance(body.value, ast.Call):
        c = body.value
        kw = {k.arg: k.value for k in c.keywords}
        if (isinstance(c.func, ast.Attribute) and c.func.attr in ("add_", "sub_") and len(c.args) == 1
                and set(kw) <= {"alpha"} and None not in kw and (P := param(c.func.value))
                and (G := grad(c.args[0])) and not any(_reads(v, p) or not seg(v) for v in kw.values())):
            alpha = f", alpha={seg(kw['alpha'])}" if "alpha" in kw else ""
            call = f"{torch}._foreach_{c.func.attr}([{P} for {p} in {xs}], [{G} for {p} in {xs}]{alpha})"
    elif (isinstance(body, ast.AugAssign) and isinstance(body.op, ast.Sub) and (P := param(body.target))
          and isinstance(body.value, ast.BinOp) and isinstance(body.value.op, ast.Mult)):
        a, b = body.value.left, body.value.right
        G, A = (grad(b), a) if grad(b) else (grad(a), b)
        if G and not _reads(A, p) and seg(A):
            call = f"{torch}._foreach_sub_([{P} for {p} in {xs}], {torch}._foreach_mul([{G} for {p} in {xs}], {seg(A)}))"
    if call is None or not xs or "\n" in call:
        return None
    indent = lines[loop.lineno - 1].encode()[:loop.col_offset].decode()  # (ast's offsets count UTF-8 bytes)
    if indent.strip():
        return None  # (another statement before the loop on its line)
    comment = lines[line - 1].encode()[body.end_col_offset:].decode().strip() if loop.lineno != line else ""
    if comment and not comment.startswith("#"):
        return None
    return Edit(file=file, start=loop.lineno, end=line, lines=[indent + call + (f"  {comment}" if comment else "")])
