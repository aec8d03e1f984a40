"""The lines of the user's source that grow a holder a graph scan found: `losses.append(loss)`,
`total += loss`, `self.rm = 0.9 * self.rm + m`, an EMA's `e.mul_(d).add_(p)`; read from the parsed
file, each file parsed and walked once, whatever the number of holders asked about.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import os
from typing import Any

import torch

from auditor.capture.frames import is_library
from auditor.capture.unseen import untraced


def _dotted(node: ast.AST) -> str | None:
    """`a.b.c` for a chain of attributes on a name, as ast.unparse spells it; None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


_GROWERS = ("append", "extend", "insert", "add", "update", "setdefault")  # methods that grow a holder


@dataclasses.dataclass(frozen=True, slots=True)
class _Growth:
    """A line inside a function (or a script's top-level loop) that may grow a holder, by the
    spellings it writes: `grown`, the holders it grows (`x += ...`, `x.append(...)`, `x[k] = ...`,
    `x.add_(...)`); with `reads` set, an assignment that grows only a holder it also reads
    (`x = x + ...`, `out, h = rnn(x, h)`); `entry`, the holders it stores an entry of
    (`x[k] = ...`), which count where `grown` does not; `key`, the constant key of the entry;
    `weak`, a store that keeps no graph (`xs.append(loss.item())`, `x[k] = 0.0`, a reset)."""

    line: int
    in_class: bool
    grown: frozenset[str] = frozenset()
    reads: frozenset[str] | None = None
    entry: frozenset[str] = frozenset()
    key: Any = None
    weak: bool = False


class _Growths(ast.NodeVisitor):
    """One walk of a tree for the lines that may grow any holder (_Growth), read for each holder's
    name by _Mutations: a scan asks for dozens of holders of the same file."""

    def __init__(self) -> None:
        self.found: list[_Growth] = []
        self.depth = 0
        self.in_class = 0

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.in_class += 1
        self.generic_visit(node)
        self.in_class -= 1

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_For(self, node: ast.For | ast.While) -> None:
        """A loop at a script's top level runs every step (a script's training loop): its lines
        count as a function's do. Outside loops, the top level runs once (setup)."""
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_While = visit_AsyncFor = visit_For

    def _add(self, line: int, **kw: Any) -> None:
        self.found.append(_Growth(line, self.in_class > 0, **kw))

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        t = node.target  # `total += loss`, `stats["loss"] += loss`
        if self.depth:
            self._add(node.lineno, grown=_spelled(t, t.value if isinstance(t, ast.Subscript) else None),
                      key=_constant_key(t), weak=_keeps_no_graph(node.value))
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        if self.depth:
            # (`out, h = rnn(x, h)`: a state fed back, unpacked with the output)
            targets = [e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            literal = not any(isinstance(n, (ast.Name, ast.Attribute, ast.Call)) for n in ast.walk(node.value))
            self._add(node.lineno, grown=_spelled(*targets), reads=_spelled(*ast.walk(node.value)),
                      entry=_spelled(*(t.value for t in node.targets if isinstance(t, ast.Subscript))),
                      key=_constant_key(node.targets[0]), weak=literal)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        # (`losses.append(loss)`, or into an entry: `stats["loss"].append(loss)`; in place,
        # `self.rm.mul_(0.9).add_(0.1 * m)`: a graph per step)
        if self.depth and isinstance(f, ast.Attribute) and (f.attr in _GROWERS or _in_place(f.attr)):
            self._add(node.lineno, grown=_spelled(f.value, f.value.value if isinstance(f.value, ast.Subscript) else None),
                      key=_constant_key(f.value),
                      weak=bool(node.args) and all(_keeps_no_graph(a) for a in node.args))  # `xs.append(loss.item())`
        self.generic_visit(node)


def _spelled(*nodes: ast.AST | None) -> frozenset[str]:
    return frozenset(d for d in map(_dotted, nodes) if d is not None)


def _constant_key(node: ast.AST) -> Any:
    return node.slice.value if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) else None


class _Mutations:
    """Lines inside functions that grow the holder `name` (`x += ...`, `x = x + ...`,
    `x.append(...)`, `x[key] = ...`, `x.update(...)`, `x.add_(...)`), read from a walk's _Growths.
    A holder `buffer.obs` is grown by its class's own methods as `self.obs`."""

    def __init__(self, name: str, found: list[_Growth]) -> None:
        parts = name.split(".")
        in_class = {name, f"self.{parts[1]}"} if len(parts) == 2 else {name}
        self.lines: list[int] = []
        self.weak: set[int] = set()  # a store that keeps no graph (a reset), not the growth
        self.keys: dict[int, Any] = {}  # line -> the constant key of the entry it grows (`x["loss"] += ...`)
        for g in found:
            spelled = in_class if g.in_class else {name}
            if g.reads is None:  # (a call or an augmented assignment)
                if spelled & g.grown:
                    self._grows(g, g.weak)
            elif spelled & g.grown and spelled & g.reads:
                self.lines.append(g.line)
            elif spelled & g.entry:
                self._grows(g, g.weak)

    def _grows(self, g: _Growth, weak: bool) -> None:
        self.lines.append(g.line)
        if g.key is not None:
            self.keys[g.line] = g.key
        if weak:
            self.weak.add(g.line)


_NO_GRAPH = frozenset({"item", "detach", "tolist", "numpy", "float", "int"})  # calls whose result keeps no graph


def _keeps_no_graph(value: ast.AST) -> bool:
    """`loss.item()`, `loss.detach()`, `float(loss)`: a value stored this way carries no graph, so
    its line is not the one that grows a holder's graph (a line beside it may be)."""
    return isinstance(value, ast.Call) and (
        (isinstance(value.func, ast.Attribute) and value.func.attr in _NO_GRAPH)
        or (isinstance(value.func, ast.Name) and value.func.id in _NO_GRAPH))


def _in_place(method: str) -> bool:
    """A tensor method that writes into its tensor (`mul_`, `add_`, `copy_`): given a tensor that
    carries a graph, it extends the holder's history as an assignment would."""
    return method.endswith("_") and not method.startswith("_")


_NOT_VALUES = frozenset({"requires_grad_", "share_memory_", "retain_grad"})  # in place, but no value written


def _receiver(node: ast.AST) -> ast.AST:
    """The object a chain of calls and attributes starts from: `e` of `e.mul_(d).add_(p)`."""
    while isinstance(node, (ast.Call, ast.Attribute)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _loop_names(target: ast.AST, it: ast.AST, module: str) -> list[str]:
    """Names a `for` binds to the parameters of the module spelled `module`: `e` in `for e in
    ema.parameters()`, `for _, e in ema.named_parameters()`, `for e, p in zip(ema.parameters(),
    model.parameters())`."""
    def of(t: ast.AST, source: ast.AST) -> list[str]:
        if not (isinstance(source, ast.Call) and isinstance(source.func, ast.Attribute)
                and source.func.attr in ("parameters", "named_parameters")
                and ast.unparse(source.func.value) == module):
            return []
        if source.func.attr == "named_parameters":
            t = t.elts[-1] if isinstance(t, ast.Tuple) and t.elts else None
        return [t.id] if isinstance(t, ast.Name) else []

    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "zip" \
            and isinstance(target, ast.Tuple) and len(target.elts) == len(it.args):
        return [n for t, a in zip(target.elts, it.args) for n in of(t, a)]
    return of(target, it)


def parameter_update_lines(source_file: str, name: str) -> list[int]:
    """Lines that update the parameter holder `name` (`ema.0.weight`) in place, in a loop over its
    module's parameters: `e.mul_(d).add_(p, alpha=1 - d)`, `e.copy_(...)`, `e.lerp_(p, w)` (not
    through `.data`, which keeps no history). The module is spelled by a prefix of the name, or
    as `self.<attr>` in a class's method for an attribute of a global (`trainer.ema`)."""
    src = _source(source_file)
    if src is None:
        return []
    parts = name.split(".")
    spellings = {".".join(parts[:k]) for k in range(1, len(parts))}
    if len(parts) > 2:
        spellings.add(f"self.{parts[1]}")
    found: set[int] = set()
    functions = (n for n in ast.walk(src[1]) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    for loop in {n for f in functions for n in ast.walk(f)}:  # (a setup loop at module level runs once)
        if not isinstance(loop, ast.For):
            continue
        names = {n for spelled in spellings for n in _loop_names(loop.target, loop.iter, spelled)}
        if not names:
            continue
        for node in (n for stmt in loop.body for n in ast.walk(stmt)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _in_place(node.func.attr) \
                    and node.func.attr not in _NOT_VALUES:
                base = _receiver(node.func)
                if isinstance(base, ast.Name) and base.id in names and ".data." not in ast.unparse(node.func) + ".":
                    found.add(node.lineno)
    return sorted(found)


_sources: dict[tuple[str, int, int], tuple[str, ast.Module] | None] = {}


def _source(source_file: str) -> tuple[str, ast.Module] | None:
    """(text, tree) of a file, kept per (path, mtime, size): every holder of every scan looks into
    the same few files, and a module walk can bring dozens of holders."""
    try:
        st = os.stat(source_file)
    except OSError:
        return None
    key = (source_file, st.st_mtime_ns, st.st_size)
    if key not in _sources:
        try:
            with open(source_file, encoding="utf-8") as fh:
                text = fh.read()
            _sources[key] = (text, ast.parse(text))
        except (OSError, SyntaxError, ValueError):
            _sources[key] = None
    return _sources[key]


_walked: dict[int, list[_Growth]] = {}  # id of a parsed tree -> its walk
_visited: dict[tuple[int, str], _Mutations] = {}  # (id of a parsed tree, holder name) -> its lines


def _mutations(source_file: str, name: str) -> _Mutations | None:
    """The walk of `source_file` for the lines that grow `name`, kept per parsed tree (a file
    edited since is parsed, and walked, again): each scan asks for the same holders. None when
    the file is unreadable or does not spell the name's last part (a line that grows `a.b.rm`
    spells `rm`: most of a module's holders, `model.3.running_mean`, appear nowhere in the
    training script)."""
    src = _source(source_file)
    if src is None or name.rsplit(".", 1)[-1] not in src[0]:
        return None
    key = (id(src[1]), name)  # (the trees are kept in _sources: an id is never reused)
    v = _visited.get(key)
    if v is None:
        with untraced():  # (a tree walk: thousands of calls, the auditor's own)
            if id(src[1]) not in _walked:
                walk = _Growths()
                walk.visit(src[1])
                _walked[id(src[1])] = walk.found
            v = _visited[key] = _Mutations(name, _walked[id(src[1])])
    return v


def mutation_lines(source_file: str, name: str, step_lines: tuple[int, int] | None = None) -> list[int]:
    """Lines that grow the holder `name`, the likeliest first: those inside the step function
    (`step_lines`, its first and last line), then any but the stores of a literal (`x[k] = 0.0`, a
    reset), then in file order."""
    v = _mutations(source_file, name)
    if v is None:
        return []
    lo, hi = step_lines or (0, -1)
    return sorted(set(v.lines), key=lambda n: (not lo <= n <= hi, n in v.weak, n))


def mutation_keys(source_file: str, name: str) -> dict[int, Any]:
    """{line: key} for the lines that grow an entry of the holder `name` spelled with a constant
    key (`stats["loss"] += loss`, `stats["outputs"].append(out)`)."""
    v = _mutations(source_file, name)
    return {} if v is None else v.keys


def _class_defs(tree: ast.Module) -> dict[str, ast.ClassDef]:
    """ClassDef nodes by qualified name as Python spells `__qualname__` (`Outer.Inner`,
    `make.<locals>.Net`)."""
    out: dict[str, ast.ClassDef] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                out.setdefault(prefix + child.name, child)
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                walk(child, f"{prefix}{child.name}.<locals>.")
            else:
                walk(child, prefix)

    walk(tree, "")
    return out


_attr_lines: dict[tuple[type, str], tuple[str, int] | None] = {}


def attribute_line(cls: type, attr: str) -> tuple[str, int] | None:
    """(file, line) of the first line in the user's own classes (`cls` and the bases it inherits
    from, up to nn.Module) whose methods grow `self.<attr>`: `self.rm = 0.9 * self.rm + ...`,
    `self.queue = torch.cat([self.queue, k])`, `self.cache.append(...)`. Library classes (torch's
    BatchNorm) are not the user's to patch, and name no line. Cached per (class, attribute):
    classes do not change between scans."""
    key = (cls, attr)
    if key in _attr_lines:
        return _attr_lines[key]
    found = None
    for klass in cls.__mro__:
        if klass is torch.nn.Module or klass is object:
            break
        try:
            file = inspect.getsourcefile(klass)
        except (TypeError, OSError):
            continue
        if not file or is_library(file):
            continue
        src = _source(file)
        node = _class_defs(src[1]).get(klass.__qualname__) if src is not None else None
        if node is None:
            continue
        walk = _Growths()
        walk.visit(node)
        v = _Mutations(f"self.{attr}", walk.found)
        if v.lines:
            found = (file, min(v.lines))
            break
    _attr_lines[key] = found
    return found
