"""A host->device copy of a tensor the same code just built on the host, read from the copy's line.

A rehearsal records each copy to the GPU at its line (`h2d-copy`); `host_built(file, line)` reads
that line's statement and says whether what it copies was made on the host right there:
* a torch factory called on the host and copied at once: `torch.ones(bs, 1).to(device)`,
  `torch.randn(bs, latent).cuda()`;
* a name the same loop (or function) body bound to such a factory call on an earlier line, with no
  other binding between: `z = torch.randn(bs, latent)` ... `z.to(device)`;
* a legacy CUDA type given a NumPy draw: `Tensor(np.random.normal(0, 1, (n, d)))`.
The edit makes it on the device: the factory given `device=` (the copy's own device expression),
the copy left to run as a no-op or dropped where it was chained; the NumPy draw becomes the
type's own `normal_`/`uniform_`/`random_`. A random draw on the device comes from the device's
generator, so its numbers differ from the host draw's (`random` is True); a constant keeps its
values exactly.
"""
from __future__ import annotations

import ast
from typing import NamedTuple

from auditor.findings import Edit
from auditor.fixes import call_name, parse_file

CONSTANTS = frozenset({"ones", "zeros", "full", "empty", "arange", "linspace", "eye", "tensor", "ones_like",
                       "zeros_like", "full_like", "empty_like"})
RANDOM = frozenset({"randn", "rand", "randint", "randperm", "normal", "randn_like", "rand_like", "randint_like"})
# NumPy draws and the in-place torch draw of the same distribution: (numpy name, torch method, its arguments)
_NUMPY_DRAWS = {"normal": ("normal_", ("loc", "scale")), "uniform": ("uniform_", ("low", "high")),
                "randint": ("random_", ("low", "high"))}
_COPIES = frozenset({"to", "cuda"})


class HostBuilt(NamedTuple):
    """What a copy's line copies: `made` the factory (`torch.ones`, `np.random.normal`), `line` where
    it is made, `random` whether it draws random numbers, `edit` the edit making it on the device
    (None when none is safe to derive)."""

    made: str
    line: int
    random: bool
    edit: Edit | None


def host_built(file: str | None, line: int | None) -> HostBuilt | None:
    """What the copy to the device at `line` of `file` copies, when the code made it on the host
    just before (see module doc); None otherwise, or when the file cannot be read."""
    if not file or not line:
        return None
    parsed = parse_file(file)
    if parsed is None:
        return None
    tree, lines = parsed
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not _on_line(node, line):
            continue
        if call_name(node) in _COPIES and isinstance(node.func, ast.Attribute):
            found = _copied_factory(tree, lines, file, node)
        else:
            found = _legacy_draw(lines, file, node)
        if found is not None:
            return found
    return None


def _on_line(node: ast.Call, line: int) -> bool:
    f = node.func
    return (f.end_lineno if isinstance(f, ast.Attribute) else node.lineno) == line


def _factory(node: ast.AST) -> str | None:
    """`ones` of `torch.ones(...)` (a torch factory, CONSTANTS or RANDOM); None otherwise."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch" and node.func.attr in CONSTANTS | RANDOM):
        return node.func.attr
    return None


def _device_of(copy: ast.Call) -> str | None:
    """The device expression of `.to(device)` / `.to(device=d, non_blocking=...)` / `.cuda()`, as
    source; None when the copy does more than move (a dtype, a memory format, another tensor)."""
    extra = [k for k in copy.keywords if k.arg not in ("device", "non_blocking")]
    if extra or any(isinstance(a, ast.Starred) for a in copy.args):
        return None
    if call_name(copy) == "cuda":
        return '"cuda"' if not copy.args else None
    given = [*copy.args[:1], *(k.value for k in copy.keywords if k.arg == "device")]
    if len(given) != 1 or len(copy.args) > 1 or not isinstance(given[0], (ast.Name, ast.Attribute, ast.Constant)):
        return None
    if isinstance(given[0], ast.Constant) and not isinstance(given[0].value, str):
        return None
    return ast.unparse(given[0])


def _with_device(factory: ast.Call, device: str) -> str | None:
    """The factory call's source with `device=` added; None where that is not safe (a device or
    generator of its own: a host generator cannot draw for the device)."""
    if any(k.arg in ("device", "generator", "out") or k.arg is None for k in factory.keywords):
        return None
    call = ast.Call(func=factory.func, args=factory.args,
                    keywords=[*factory.keywords, ast.keyword(arg="device", value=ast.parse(device, mode="eval").body)])
    return ast.unparse(call)


def _copied_factory(tree: ast.Module, lines: list[str], file: str, copy: ast.Call) -> HostBuilt | None:
    assert isinstance(copy.func, ast.Attribute)
    source, device = copy.func.value, _device_of(copy)
    name = _factory(source)
    if name is not None:  # torch.ones(bs, 1).to(device): one expression, made on the device instead
        assert isinstance(source, ast.Call)
        new = _with_device(source, device) if device else None
        edit = _replace(lines, file, copy, new) if new and copy.lineno == copy.end_lineno else None
        return HostBuilt(f"torch.{name}", copy.lineno, name in RANDOM, edit)
    if not isinstance(source, ast.Name):
        return None
    bound = _bound_before(tree, source.id, copy.lineno)
    if bound is None:
        return None
    name = _factory(bound.value)
    if name is None:
        return None
    assert isinstance(bound.value, ast.Call)
    new = _with_device(bound.value, device) if device else None
    edit = _replace(lines, file, bound.value, new) if new and bound.value.lineno == bound.value.end_lineno else None
    return HostBuilt(f"torch.{name}", bound.lineno, name in RANDOM, edit)


def _bound_before(tree: ast.Module, name: str, line: int) -> ast.Assign | None:
    """The assignment `name = ...` that last binds `name` before `line` in the body of the loop (or
    function, or module) holding `line`, when no other statement there binds it in between."""
    holder = _innermost_body(tree, line)
    last = None
    for node in ast.walk(holder):
        if not isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.For)) or node.lineno >= line:
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if any(isinstance(n, ast.Name) and n.id == name for t in targets for n in ast.walk(t)):
            if last is None or node.lineno > last.lineno:
                last = node
    if not isinstance(last, ast.Assign) or len(last.targets) != 1 or not isinstance(last.targets[0], ast.Name):
        return None
    return last


def _innermost_body(tree: ast.Module, line: int) -> ast.AST:
    best: ast.AST = tree
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.While, ast.FunctionDef, ast.AsyncFunctionDef)) and \
                node.lineno < line <= (node.end_lineno or node.lineno):
            if best is tree or node.lineno > getattr(best, "lineno", 0):
                best = node
    return best


def _legacy_draw(lines: list[str], file: str, call: ast.Call) -> HostBuilt | None:
    """`Tensor(np.random.normal(0, 1, (n, d)))`, the legacy type given a NumPy draw: made with the
    type's own draw, `Tensor(n, d).normal_(0, 1)` (the type is the program's, CUDA or not)."""
    if len(call.args) != 1 or call.keywords or not isinstance(call.func, (ast.Name, ast.Attribute)):
        return None
    draw = call.args[0]
    f = draw.func if isinstance(draw, ast.Call) else None
    if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Attribute) and f.value.attr == "random"
            and isinstance(f.value.value, ast.Name) and f.value.value.id in ("np", "numpy")):
        return None
    assert isinstance(draw, ast.Call)
    made = f"np.random.{f.attr}"
    return HostBuilt(made, call.lineno, True, _legacy_edit(lines, file, call, draw, f.attr))


def _legacy_edit(lines: list[str], file: str, call: ast.Call, draw: ast.Call, dist: str) -> Edit | None:
    if dist not in _NUMPY_DRAWS or call.lineno != call.end_lineno:
        return None
    method, names = _NUMPY_DRAWS[dist]
    given = {**dict(zip([*names, "size"], draw.args)), **{k.arg: k.value for k in draw.keywords if k.arg}}
    size = given.pop("size", None)
    if size is None or set(given) - set(names) or len(given) != 2 or len(draw.args) > 3:
        return None
    sizes = ", ".join(map(ast.unparse, size.elts)) if isinstance(size, ast.Tuple) else ast.unparse(size)
    args = ", ".join(ast.unparse(given[n]) for n in names)
    new = f"{ast.unparse(call.func)}({sizes}).{method}({args})"
    return _replace(lines, file, call, new)


def _replace(lines: list[str], file: str, node: ast.AST, new: str | None) -> Edit | None:
    """The edit replacing `node` (on one line) with `new`."""
    if new is None or node.lineno != node.end_lineno:
        return None
    text = lines[node.lineno - 1]
    start, end = _offsets(text, node.col_offset), _offsets(text, node.end_col_offset or 0)
    return Edit(file=file, start=node.lineno, end=node.lineno, lines=[text[:start] + new + text[end:]])


def _offsets(text: str, utf8_col: int) -> int:
    """A character offset of `text` from the UTF-8 byte offset ast gives."""
    return len(text.encode("utf-8")[:utf8_col].decode("utf-8", errors="ignore"))

