"""TARGET: `path/to/file.py:callable` or `package.module:callable` (a step function), or a whole
program: `path/to/file.py` (run as `python file.py`) or `-m package.module` (as `python -m`)."""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


class TargetError(Exception):
    """A TARGET the user must fix (usage error, exit 2)."""


@dataclass(frozen=True)
class Target:
    spec: str
    module: str  # dotted module name, or the file's stem
    attr: str
    file: str | None = None  # absolute path for file targets
    # "callable": the step function `attr` is called N times; "script" (`file.py`) and "module"
    # (`-m package.module`): the whole program runs as Python runs it (auditor.capture.program)
    kind: str = "callable"

    @property
    def name(self) -> str:
        """A file name for the run (its output directory, its profiler traces): the module's last
        part and the callable, with each character that is not printable (a newline in a file's
        name) and each path separator written as "_"."""
        last = self.module.rsplit('.', 1)[-1]
        name = f"{last}-{self.attr}" if self.attr else last
        return "".join(c if c.isprintable() and c not in "/\\" else "_" for c in name)

    @property
    def is_program(self) -> bool:
        return self.kind != "callable"


MODULE_PREFIX = "-m "  # a program target's spec for `audit run -m package.module`


def module_target(name: str) -> Target:
    """`-m package.module`: the program is the module, run as `python -m` runs it."""
    if not name or not all(p.isidentifier() for p in name.split(".")):
        raise TargetError(f"bad module {name!r} for -m: expected a dotted module name (package.module)")
    return Target(MODULE_PREFIX + name, name, "", kind="module")


def _not_python(path: str) -> TargetError:
    return TargetError(f"{path}: not a Python file (TARGET is path/to/file.py:callable or package.module:callable)")


def parse_target(spec: str) -> Target:
    """Check the shape of TARGET without importing anything (the parent does this)."""
    if spec.startswith(MODULE_PREFIX):
        return module_target(spec[len(MODULE_PREFIX):])
    if ":" not in spec and (spec.endswith(".py") or os.path.isfile(spec)):
        return _script_target(spec)
    left, sep, attr = spec.rpartition(":")
    if not sep or not left or not attr:
        raise TargetError(f"bad TARGET {spec!r}: expected path/to/file.py, path/to/file.py:callable "
                          f"or package.module:callable (or -m package.module)")
    if not attr.replace(".", "_").isidentifier():
        raise TargetError(f"bad TARGET {spec!r}: {attr!r} is not a Python name")
    if left.endswith(".py") or os.sep in left or "/" in left:
        path = Path(left)
        if not path.is_file():
            raise TargetError(f"no such file: {left}")
        resolved = str(path.resolve())
        try:  # (every report names this file; undecodable bytes could be written in none of them)
            resolved.encode("utf-8")
        except UnicodeEncodeError:
            raise TargetError(f"the path of {ascii(left)} is not valid UTF-8: rename it or move it to a UTF-8 path") from None
        # importlib loads only what its file name says is Python (.py, or compiled): anything else
        # (a checkpoint.pt, notes.txt) would fail in the child as a crash of the user's target
        if importlib.util.spec_from_file_location(path.stem, resolved) is None:
            raise _not_python(left)
        return Target(spec, path.stem, attr, resolved)
    if not all(p.isidentifier() for p in left.split(".")):
        raise TargetError(f"bad TARGET {spec!r}: {left!r} is neither a .py file nor a module path")
    return Target(spec, left, attr)


def _script_target(spec: str) -> Target:
    """`path/to/file.py`: the program in that file, run as `python path/to/file.py` runs it."""
    path = Path(spec)
    if not path.is_file():
        raise TargetError(f"no such file: {spec}")
    resolved = str(path.resolve())
    try:
        resolved.encode("utf-8")
    except UnicodeEncodeError:
        raise TargetError(f"the path of {ascii(spec)} is not valid UTF-8: rename it or move it to a UTF-8 path") from None
    return Target(spec, path.stem, "", resolved, kind="script")


def import_target(target: Target) -> tuple[types.ModuleType, Callable, str | None]:
    """Import the module (running the user's setup code) and find the step callable.

    Raises TargetError for problems with TARGET itself; exceptions from the user's module code
    propagate unchanged (the target failed)."""
    if target.file is not None:
        directory = os.path.dirname(target.file)
        if directory not in sys.path:
            sys.path.insert(0, directory)
        spec = importlib.util.spec_from_file_location(target.module, target.file)
        if spec is None or spec.loader is None:  # (parse_target refuses these first; a Target built by hand)
            raise _not_python(target.file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[target.module] = module
        spec.loader.exec_module(module)
        source = target.file
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(target.module)
        except ModuleNotFoundError as e:
            parts = target.module.split(".")
            if e.name in {".".join(parts[:i]) for i in range(1, len(parts) + 1)}:
                raise TargetError(f"no such module: {target.module}") from None
            raise
        source = getattr(module, "__file__", None)
    fn: object = module
    for part in target.attr.split("."):
        if not hasattr(fn, part):
            raise TargetError(f"no callable {target.attr!r} in {target.file or target.module}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise TargetError(f"{target.attr!r} in {target.file or target.module} is not callable")
    return module, fn, source


def step_arity(fn: Callable) -> int:
    """0 or 1: whether the step takes the step index. Anything else is a usage error."""
    # calling these returns a generator or coroutine and runs none of the body: every "step"
    # would do nothing, and the audit would report a clean, instant run
    name = getattr(fn, "__name__", "the step")
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        raise TargetError(f"{name} is a generator function: calling it runs none of its body; "
                          f"audit a plain function that does one step")
    if inspect.iscoroutinefunction(fn):
        raise TargetError(f"{name} is an async function: calling it runs none of its body; "
                          f"audit a plain function that runs one step (e.g. with asyncio.run)")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return 0
    required = [p for p in sig.parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    positional = [p for p in sig.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    if len(required) > 1:
        raise TargetError(f"the step callable must take no argument or one (the step index); "
                          f"{fn.__name__} requires {len(required)}")
    keyword_only = [p.name for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    if keyword_only:  # (the step is called with the index, if any, by position: this would fail at step 0)
        raise TargetError(f"the step callable must take no argument or one (the step index); "
                          f"{name} requires the keyword-only argument {keyword_only[0]!r}")
    return 1 if positional else 0


def check_statically(target: Target) -> None:
    """For launchers, which cannot see a rank's usage error: a file target whose callable is not
    bound at the module's top level (def, class, assignment, import) is refused without running it.
    Modules that bind names dynamically (`from x import *`, `globals()`) are given the benefit of the doubt.
    A module program (`-m pkg.mod`) that `python -m` would not find is refused too."""
    if target.kind == "module" and not _module_found(target.module):
        raise TargetError(f"no such module: {target.module}")
    if target.file is None or target.is_program:
        return
    import ast

    try:
        tree = ast.parse(Path(target.file).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return  # the rank will report it with the full error
    name = target.attr.split(".")[0]
    bound: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                bound.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(a.name == "*" for a in node.names):
                return
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif not isinstance(node, ast.Expr):
            return  # if/try/with/for at top level may bind it: let the rank decide
    if name not in bound:
        raise TargetError(f"no callable {target.attr!r} in {target.file}")


def _module_found(name: str) -> bool:
    """Whether `python -m name` (run from the current directory) would find the module, looked up
    without importing anything. A package whose `__init__.py` extends its own `__path__` is
    given the benefit of the doubt for what is under it."""
    from importlib.machinery import PathFinder

    parts = name.split(".")
    try:
        spec = PathFinder.find_spec(parts[0], [os.getcwd(), *sys.path[1:]]) or importlib.util.find_spec(parts[0])
        for i in range(1, len(parts)):
            if spec is None or not spec.submodule_search_locations:
                return False
            init = spec.origin if spec.origin and spec.has_location else None
            if init and "__path__" in Path(init).read_text(encoding="utf-8", errors="replace"):
                return True
            spec = PathFinder.find_spec(".".join(parts[:i + 1]), list(spec.submodule_search_locations))
    except (ImportError, ValueError, OSError):
        return True  # (the rank will say what is wrong)
    return spec is not None
