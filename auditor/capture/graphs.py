"""Graph-leak evidence: tensors that carry autograd history and outlive the step that made them.

Right after a step returns, its locals are gone; any non-leaf tensor still alive is held by module
state (a running loss kept as a tensor, outputs appended to a list). If the autograd graph reachable
from those tensors keeps growing from one step boundary to the next, graphs are piling up.
Scans walk every gc-tracked object (50-100 ms with torch imported), so they run at a few sampled
boundaries only.
"""
from __future__ import annotations

import ast
import gc
import types
from collections import deque
from typing import Any

import torch

_CONTAINERS = (list, tuple, dict, set, deque)


def _graph_size(tensors: list[torch.Tensor]) -> int:
    seen: set[int] = set()
    keep: list[Any] = []  # keep wrappers alive during the walk so ids stay unique
    stack = [t.grad_fn for t in tensors]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        keep.append(node)
        stack.extend(n for n, _ in node.next_functions)
    return len(seen)


_DEPTH = 3  # a list of tuples of tensors is two levels down; one more for a list inside a row
_BUDGET = 2_000_000  # items looked at per holder: a scan stays well under a second


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """Tensors held directly or inside containers a few levels down: a replay buffer is a list (or
    deque) of (obs, action, log_prob) tuples, of dicts, or of small objects, not of bare tensors."""
    out: list[torch.Tensor] = []
    stack = [(value, 0)]
    seen: set[int] = set()
    budget = _BUDGET
    while stack and budget > 0:
        v, depth = stack.pop()
        if isinstance(v, torch.Tensor):
            if not isinstance(v, torch.nn.Parameter):
                out.append(v)
            continue
        if depth >= _DEPTH or id(v) in seen:
            continue
        seen.add(id(v))
        if isinstance(v, dict):
            items: Any = v.values()
        elif isinstance(v, _CONTAINERS):
            items = v
        elif depth and not isinstance(v, (torch.nn.Module, type, types.ModuleType, types.FunctionType)) \
                and isinstance(getattr(v, "__dict__", None), dict):
            items = vars(v).values()  # a row that is an object (a dataclass Transition)
        else:
            continue
        for x in items:
            stack.append((x, depth + 1))
            budget -= 1
    return out


def _nbytes(tensors: list[torch.Tensor]) -> int:
    storages = {}
    for t in tensors:
        try:
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
        except (RuntimeError, NotImplementedError):
            continue
    return sum(storages.values())


def _holders(module: types.ModuleType | None) -> list[tuple[str, str, list[torch.Tensor]]]:
    """(name, kind, tensors) for the target module's globals (and one level of their attributes)
    that hold tensors other than parameters."""
    if module is None:
        return []
    out = []
    for name, value in list(vars(module).items()):
        if name.startswith("__") or isinstance(value, (types.ModuleType, type, types.FunctionType)):
            continue
        found = _tensors_in(value)
        if found:
            out.append((name, type(value).__name__, found))
            continue
        attrs = getattr(value, "__dict__", None)
        if isinstance(attrs, dict) and not isinstance(value, torch.nn.Module):
            for attr, v in list(attrs.items()):
                found = _tensors_in(v)
                if found:
                    out.append((f"{name}.{attr}", type(v).__name__, found))
    return out


_GROWERS = ("append", "extend", "insert", "add", "update", "setdefault")  # methods that grow a holder


class _Mutations(ast.NodeVisitor):
    """Lines inside functions that grow a named holder: `x += ...`, `x = x + ...`, `x.append(...)`,
    `x[key] = ...`, `x.update(...)`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.parts = name.split(".")
        self.lines: list[int] = []
        self.depth = 0
        self.in_class = 0

    def _is_name(self, node: ast.AST) -> bool:
        text = ast.unparse(node)
        # `buffer.obs` is grown by its class's own methods as `self.obs`
        return text == self.name or (self.in_class > 0 and len(self.parts) == 2 and text == f"self.{self.parts[1]}")

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.in_class += 1
        self.generic_visit(node)
        self.in_class -= 1

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if self.depth and self._is_name(node.target):
            self.lines.append(node.lineno)
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        if self.depth and (
                (any(self._is_name(t) for t in node.targets) and any(self._is_name(n) for n in ast.walk(node.value)))
                or any(isinstance(t, ast.Subscript) and self._is_name(t.value) for t in node.targets)):
            self.lines.append(node.lineno)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        if self.depth and isinstance(f, ast.Attribute) and f.attr in _GROWERS and self._is_name(f.value):
            self.lines.append(node.lineno)
        self.generic_visit(node)


def mutation_lines(source_file: str, name: str) -> list[int]:
    try:
        with open(source_file, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
    except (OSError, SyntaxError, ValueError):
        return []
    v = _Mutations(name)
    v.visit(tree)
    return sorted(set(v.lines))


def scan(module: types.ModuleType | None, source_file: str | None) -> dict[str, Any]:
    """Count live graph-carrying tensors and the graph behind them; name the globals holding tensors
    (with their bytes, for memory-growth) and the lines that grow them."""
    tensor = torch.Tensor  # (a local: this test runs once per gc-tracked object, ~300k of them)
    live = [t for t in [o for o in gc.get_objects() if type(o) is tensor] if t.grad_fn is not None]
    holders = []
    for name, kind, tensors in _holders(module):
        lines = mutation_lines(source_file, name) if source_file else []
        with_graph = [t for t in tensors if t.grad_fn is not None]
        holders.append({"name": name, "kind": kind, "tensors": len(tensors), "graph_tensors": len(with_graph),
                        "nodes": _graph_size(with_graph), "bytes": _nbytes(tensors),
                        "where": {"file": source_file, "line": lines[0], "function": ""} if lines else None})
    return {"tensors": len(live), "graph_nodes": _graph_size(live), "holders": holders}
