"""The package's shape is a contract with its readers: the layers import downward only, no module
imports itself back through others, and no module grows past what a reader can hold at once.

Imports are read from the source (module level and inside functions alike). For the layers, imports
under `if TYPE_CHECKING:` are names for type checkers only, never run, and are left out. For import
circles they count: a module that names another's type is read with it, and two modules that each
need the other to be read (or type-checked) are one module in two files. An import inside a
function counts too (moving an import into a function hides a circle; it does not break it).
`from P import x` also depends on the package P (its `__init__` runs first and `x` is read from it),
unless P's `__init__` only re-exports (nothing in it but imports, its docstring and `__all__`): a
package that re-exports its own modules is their index, not a module of its own."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import msgspec

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "auditor"
MAX_LINES = 900

# What each part may import besides itself and the package's own `auditor/__init__.py` (its version
# and the `auditor.step()` marker, `step_marker`). The layers are capture -> evidence -> rules ->
# reports; `findings` (what rules return), `fixes` (code edits) and `config` are shared below the
# rules and reports; `command_options` (the commands' typed options) is read by the application and
# by the audited child (capture); the application (`app`, `cli`, `launch`, `verify`, `__main__`) may
# import anything.
ALLOWED = {
    "step_marker": set(),
    "evidence": set(),
    "findings": {"evidence"},
    "command_options": {"findings", "evidence"},
    "cst_edits": set(),  # (libcst spans of a call's arguments: what fixes' minimal edits splice)
    "fixes": {"findings", "evidence", "cst_edits"},
    "config": {"findings", "evidence", "rules.registry"},
    "capture": {"evidence", "findings", "config", "fixes", "command_options", "step_marker"},
    "rules": {"evidence", "findings", "config", "fixes"},
    "reports": {"evidence", "findings", "fixes", "config", "rules.registry"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _runtime_nodes(tree: ast.AST):
    """Every node but those under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _imports(name: str, path: Path, type_checking: bool = False) -> set[str]:
    """The package's modules `name` imports; with `type_checking`, also those it imports for type
    checkers only, and the packages whose namespace a `from P import x` reads (see the module doc)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    for node in (ast.walk(tree) if type_checking else _runtime_nodes(tree)):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in MODULES else base)
                if type_checking and full in MODULES and base in MODULES and not _only_reexports(base):
                    found.add(base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    found = {m for m in found if m in MODULES and m != name}
    if type_checking and path.name == "__init__.py" and _only_reexports(name):
        found = {m for m in found if not m.startswith(name + ".")}
    return found


def _only_reexports(package: str) -> bool:
    """Whether the package's `__init__` holds nothing but imports, its docstring and `__all__`."""
    path = MODULES[package]
    return path.name == "__init__.py" and _reexports_only(path.read_text())


def _reexports_only(source: str) -> bool:
    """Whether `source` holds nothing but imports, its docstring, `__all__` and `__version__`, and a
    module `__getattr__` (PEP 562: what it offers imported on first use)."""
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] in (["__all__"], ["__version__"]):
            continue
        return False
    return True


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}
# every import, for circles: type checkers' too, and the packages read by `from P import x`
DEPENDS = {name: _imports(name, path, type_checking=True) for name, path in MODULES.items()}


def _part(module: str) -> str:
    """The part of the architecture a module belongs to: its top folder or top-level module, with
    the rule registry apart from the rules (reports read rule docs through it)."""
    parts = module.split(".")[1:]
    if parts[:2] == ["rules", "registry"]:
        return "rules.registry"
    return parts[0] if parts else ""


def test_layers_import_downward_only():
    wrong = sorted(f"{module} imports {dep}" for module, deps in GRAPH.items() for dep in deps
                   if (part := _part(module)) in ALLOWED and _part(dep) not in ALLOWED[part] | {part, ""}
                   and not (part == "rules" and _part(dep) == "rules.registry"))
    assert wrong == []


# The modules of auditor/rules/ that are no rule: the rules' base class, their registry and the
# engine that runs them (its parts: judging in a forked process, findings' attribution to causes,
# suppression comments, the primary rank's rules), and `_support`, the helpers rules share.
RULES_INFRASTRUCTURE = {"auditor.rules", "auditor.rules.base", "auditor.rules.registry", "auditor.rules.engine",
                        "auditor.rules.forked", "auditor.rules.attribution", "auditor.rules.suppression",
                        "auditor.rules.primary"}


def _rule_modules() -> set[str]:
    """The built-in rules' modules: those the `auditor.rules` entry points of pyproject.toml name."""
    try:
        import tomllib
    except ImportError:  # (Python 3.10)
        import tomli as tomllib
    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    return {spec.split(":")[0] for spec in project["entry-points"]["auditor.rules"].values()}


def test_rules_import_no_rule():
    """A rule is one module that reads evidence and returns findings: what several rules share is
    in auditor.rules._support, never read from another rule. Every other module of auditor/rules/
    is a rule or named infrastructure (a new helper goes to _support)."""
    rules = _rule_modules()
    support = {n for n in MODULES if n.startswith("auditor.rules._support")}
    assert {"auditor.rules.nonfinite", "auditor.rules.launch_bound", "auditor.rules.gpu_idle"} <= rules
    assert sorted(n for n in MODULES if n.startswith("auditor.rules") and n not in rules | support
                  | RULES_INFRASTRUCTURE) == []
    assert sorted(f"{n} imports {dep}" for n in rules | support for dep in GRAPH[n] if dep in rules) == []


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of an import graph larger than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    assert import_circles(GRAPH) == []


def test_no_import_circles_through_type_imports_or_packages():
    assert import_circles(DEPENDS) == []


def test_the_circle_check_finds_circles():
    """A circle through a type checker's import, and one through a package's `__init__` that holds
    code, are found; a package that only re-exports its modules is none."""
    assert import_circles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert "auditor.evidence.model" in DEPENDS["auditor.rules.engine"]
    assert _only_reexports("auditor.capture") and not _only_reexports("auditor.rules._support.places")
    assert _reexports_only('"""doc"""\nfrom a import b\n__all__ = ["b"]\n') and not _reexports_only("def f(): pass\n")


def test_the_checks_see_the_package():
    """The graph above is the package's: a check that read no module would pass on anything."""
    assert {"auditor.evidence.model", "auditor.rules.engine", "auditor.capture.child", "auditor.cli"} <= set(GRAPH)
    assert "auditor.evidence.model" in GRAPH["auditor.rules.engine"]


def test_a_package_init_only_reexports():
    """A package's `__init__` is its index: its docstring, imports of what it offers from its modules,
    `__all__` (and the root's `__version__`); code lives in modules named for what they hold."""
    packages = sorted(name for name, path in MODULES.items() if path.name == "__init__.py")
    assert {"auditor", "auditor.capture.probes", "auditor.reports"} <= set(packages)
    assert [p for p in packages if not _only_reexports(p)] == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_size(module):
    assert len(MODULES[module].read_text().splitlines()) <= MAX_LINES


def _untyped_fields(struct: type) -> list[str]:
    """The fields, anywhere under `struct`, whose type is or holds `Any` (a free-form dict or list)."""
    import msgspec.inspect as mi

    found, seen = [], set()

    def walk(t, where: str) -> None:
        if isinstance(t, mi.AnyType):
            found.append(where)
        elif isinstance(t, mi.StructType):
            if t.cls not in seen:
                seen.add(t.cls)
                for f in t.fields:
                    walk(f.type, f"{t.cls.__name__}.{f.name}")
        else:
            for inner in ([getattr(t, a) for a in ("item_type", "key_type", "value_type") if hasattr(t, a)]
                          + list(getattr(t, "item_types", ())) + list(getattr(t, "types", ()))):
                walk(inner, where)

    walk(mi.type_info(struct), struct.__name__)
    return found


def test_a_loaded_snapshot_is_typed_through():
    """What the snapshot reader hands the allocator simulator and the memory rules is typed to the
    leaves: no free-form dict (the settings, the annotations, the trace entries' unmodelled keys)."""
    from auditor.evidence.snapshot import Snapshot

    assert _untyped_fields(Snapshot) == []


class _Inner(msgspec.Struct):
    raw: dict[str, Any] = {}


class _Outer(msgspec.Struct):
    inner: list[_Inner] = []


def test_the_typed_check_finds_a_free_form_dict():
    assert _untyped_fields(_Outer) == ["_Inner.raw"]


def test_the_numerics_collector_protocol_is_what_its_probes_use():
    """The probes, the mode and the optimizer watch are typed by `collector_api.Collector`, not by the
    collector that installs them: the Protocol names every attribute they use of it (`col.X`), and
    the collector's classes define each one (a method, or an attribute it sets)."""
    import re

    numerics = PACKAGE / "capture" / "numerics"
    tree = ast.parse((numerics / "collector_api.py").read_text())
    protocol = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Collector")
    declared = {n.target.id for n in protocol.body if isinstance(n, ast.AnnAssign)} | {
        n.name for n in protocol.body if isinstance(n, ast.FunctionDef)}
    users = [p for p in numerics.glob("*.py") if "Collector" in p.read_text() and p.name != "collector_api.py"]
    used = {m for p in users for m in re.findall(r"\bcol\.([A-Za-z_]\w*)", p.read_text())}
    assert len(users) >= 5 and used == declared
    source = "\n".join(p.read_text() for p in numerics.glob("*.py") if p.name != "collector_api.py")
    assert [name for name in sorted(declared)
            if not re.search(rf"def {name}\(|self\.{name}(: [^=]+)? = ", source)] == []
