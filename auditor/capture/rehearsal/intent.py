"""Where a program asks for CUDA: read from its source, before any of it runs.

`program_reasons(file, module)` reads the target file (for `-m pkg.mod`, the module's file, found
without importing) and, through its imports, the user's modules it imports, transitively (at most
MAX_FILES files; a module is the user's when auditor.capture.frames.is_library says its file is
not a library's). Imports resolve as Python would at start-up, without running any module.

What asks for CUDA (`cuda_reasons`): `.cuda(...)`, a "cuda"/"cuda:N" device string, `torch.cuda.*`
or `torch.accelerator.*` beyond the memory-statistics family and the seeding calls, imports from
them, `set_default_device` with anything but a non-CUDA string, a device by its index (`.to(0)`,
`device = 0`), and a Lightning Trainer, Fabric or LightningCLI whose accelerator is left to it or
is "gpu"/"cuda". A "cuda" string a device is only tested against does not count, nor do the
memory-statistics calls alone (auditor.capture.cuda_standins answers them on a CPU).
`argument_reason(argv)`: a command-line argument that names a CUDA device (`--device=cuda`).
Each case in full: bench/HISTORY.md, "auditor/capture/rehearsal/intent.py".
"""
from __future__ import annotations

import ast
import importlib.machinery
import os
import re
import sys
from pathlib import Path
from typing import Iterator

from auditor.capture import cuda_standins
from auditor.capture.frames import is_library

_CUDA_STRING = re.compile(r"cuda(:\d+)?")
# torch.cuda / torch.accelerator functions that run on a CPU-only machine anyway (answered by cuda_standins;
# the seeding calls torch itself queues until CUDA starts, which it never does there).
MEMORY_FAMILY = {"cuda": frozenset(cuda_standins._answers()) | {"synchronize", "manual_seed", "manual_seed_all",
                                                                    "seed", "seed_all"}}
MEMORY_FAMILY["accelerator"] = MEMORY_FAMILY["cuda"] | {"empty_host_cache", "get_memory_info", "memory"}
MAX_FILES = 200  # the program's own modules read, at most
MAX_BYTES = 2 << 20  # a larger file is data, not a module anyone wrote


def cuda_reasons(path: str | Path) -> list[tuple[int, str]]:
    """(line, what) for each place in the file that asks for CUDA, in line order (see module doc).
    A method call is placed at the line of its name: a call's own `lineno` is where its receiver
    starts: the first line of an `nn.Sequential(...).cuda()` spread over lines, not the line
    holding `.cuda()`."""
    tree = _parse(path)
    return [] if tree is None else _reasons(tree)


def _parse(path: str | Path) -> ast.Module | None:
    try:
        p = Path(path)
        if p.stat().st_size > MAX_BYTES:
            return None
        return ast.parse(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return None


def _int(node: ast.AST | None) -> bool:
    """An integer literal (not a bool): a device index."""
    return isinstance(node, ast.Constant) and type(node.value) is int


# a name that holds a device (`device = 0`, `gpu_id = 0`): an integer assigned to it is a GPU's index
_DEVICE_NAME = re.compile(r"(?!n_|num_)(\w*_)?(device|gpu)(_id|_idx|_index)?", re.IGNORECASE)
# frameworks that pick the device themselves: their trainers use a GPU when one is there unless told
# `accelerator="cpu"`
_FRAMEWORKS = ("lightning", "pytorch_lightning", "lightning_fabric")
_PICKERS = frozenset({"Trainer", "Fabric"})
_CLIS = frozenset({"LightningCLI"})  # builds the Trainer itself, from `trainer_defaults` and the command line
CLI_PICKS = "(its Trainer picks a GPU when there is one)"


def _picker(node: ast.Call, clis: frozenset[str] = _CLIS) -> bool:
    """`Trainer(...)` / `L.Fabric(...)` with accelerator left to them ("auto", "gpu", "cuda" or
    unset); `LightningCLI(...)` (or a subclass of it, among `clis`) whose `trainer_defaults`
    leave it so."""
    f = node.func
    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
    if name in clis:
        defaults = next((k.value for k in node.keywords if k.arg == "trainer_defaults"), None)
        if defaults is None:
            return True
        if not isinstance(defaults, ast.Dict):
            return False  # (made elsewhere: not read)
        acc = next((v for k, v in zip(defaults.keys, defaults.values)
                    if isinstance(k, ast.Constant) and k.value == "accelerator"), None)
    elif name in _PICKERS:
        acc = next((k.value for k in node.keywords if k.arg == "accelerator"), None)
    else:
        return False
    return acc is None or (isinstance(acc, ast.Constant) and acc.value in ("auto", "gpu", "cuda"))


def _cli_classes(tree: ast.Module) -> frozenset[str]:
    """LightningCLI and the file's own subclasses of it (`class MyLightningCLI(LightningCLI)`)."""
    names = set(_CLIS)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(
                (b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "") in _CLIS
                for b in node.bases):
            names.add(node.name)
    return frozenset(names)


def _imports_framework(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        if any(n.split(".")[0] in _FRAMEWORKS for n in names):
            return True
    return False


def _tested(tree: ast.Module) -> set[int]:
    """The ids of the string constants a value is tested against: the operands of a comparison
    (`==`, `!=`, `in`, `not in`) and the arguments of `.startswith(...)` / `.endswith(...)`."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and all(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                 for op in node.ops):
            operands = [node.left, *node.comparators]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith")):
            operands = [*node.args, *(e for a in node.args if isinstance(a, ast.Tuple) for e in a.elts)]
        else:
            continue
        out.update(id(o) for o in operands if isinstance(o, ast.Constant))
    return out


def _reasons(tree: ast.Module) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    framework = _imports_framework(tree)
    clis = _cli_classes(tree) if framework else _CLIS
    tested = _tested(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _CUDA_STRING.fullmatch(node.value):
            if id(node) not in tested:
                found.append((node.lineno, f'"{node.value}"'))
        elif (isinstance(node, ast.Assign) and _int(node.value) and len(node.targets) == 1
              and isinstance(node.targets[0], (ast.Name, ast.Attribute))
              and _DEVICE_NAME.fullmatch(getattr(node.targets[0], "id", None) or node.targets[0].attr)):
            found.append((node.lineno, f"{ast.unparse(node.targets[0])} = {node.value.value}"))
        elif isinstance(node, ast.Call) and any(k.arg == "device" and _int(k.value) for k in node.keywords):
            found.append((node.lineno, "device=<index>"))
        elif framework and isinstance(node, ast.Call) and _picker(node, clis):
            name = ast.unparse(node.func)
            found.append((node.lineno, f"{name}() {CLI_PICKS}" if name.rsplit(".", 1)[-1] in clis
                          else f"{name}() (picks a GPU when there is one)"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name, line = node.func.attr, node.func.end_lineno or node.lineno
            if name == "cuda":
                found.append((line, ".cuda()"))
            elif name == "to" and node.args and _int(node.args[0]):
                found.append((line, f".to({node.args[0].value})"))
            elif (name == "device" and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                  and node.args and _int(node.args[0])):
                found.append((line, f"torch.device({node.args[0].value})"))
            elif name == "set_default_device" and not _non_cuda_string(node):
                found.append((line, "set_default_device"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "set_default_device":
            if not _non_cuda_string(node):
                found.append((node.lineno, "set_default_device"))
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
              and node.value.attr in MEMORY_FAMILY and isinstance(node.value.value, ast.Name)
              and node.value.value.id == "torch" and node.attr not in MEMORY_FAMILY[node.value.attr]):
            found.append((node.end_lineno or node.lineno, f"torch.{node.value.attr}.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and _device_api(node.module) is not None:
            family = MEMORY_FAMILY[_device_api(node.module)]
            if node.module not in ("torch.cuda", "torch.accelerator") or any(a.name not in family for a in node.names):
                found.append((node.lineno, f"from {node.module} import ..."))
    return sorted(set(found))


_CUDA_ARGUMENT = re.compile(r"(--?[\w.-]+=)?cuda(:\d+)?")
_CLI_ACCELERATOR = re.compile(r"--trainer\.accelerator(?:=(.*))?")


def argument_reason(argv: list[str]) -> str | None:
    """The first argument of the program's command line that names a CUDA device (`cuda`,
    `cuda:1`, `--device=cuda`, LightningCLI's `--trainer.accelerator gpu`), quoted; None when none does."""
    for i, a in enumerate(argv):
        if _CUDA_ARGUMENT.fullmatch(a):
            return repr(a)
        acc = cli_accelerator(argv[i:i + 2]) if a.startswith("--trainer.accelerator") else None
        if acc in ("gpu", "cuda"):
            return repr(" ".join(argv[i:i + 2]) if "=" not in a else a)
    return None


def cli_accelerator(argv: list[str]) -> str | None:
    """The accelerator LightningCLI's command line sets (`--trainer.accelerator cpu`,
    `--trainer.accelerator=gpu`), the last one given, unquoted; None when none is."""
    found = None
    for i, a in enumerate(argv):
        m = _CLI_ACCELERATOR.fullmatch(a)
        if m:
            value = m.group(1) if m.group(1) is not None else (argv[i + 1] if i + 1 < len(argv) else "")
            found = value.strip("'\"")
    return found


def _device_api(module: str | None) -> str | None:
    """"cuda" for torch.cuda and its submodules, "accelerator" for torch.accelerator's, else None."""
    parts = (module or "").split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "torch" and parts[1] in MEMORY_FAMILY else None


def _non_cuda_string(call: ast.Call) -> bool:
    arg = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "device"), None)
    return isinstance(arg, ast.Constant) and (arg.value is None or (
        isinstance(arg.value, str) and not _CUDA_STRING.fullmatch(arg.value)))


# --- the program's own modules -------------------------------------------------------------------

class _Resolver:
    """Dotted module names -> their files, as the program's imports would find them, without
    importing anything (a package's `__init__` is read, never run)."""

    def __init__(self, search: list[str]) -> None:
        self.search = search
        self.specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def spec(self, name: str) -> importlib.machinery.ModuleSpec | None:
        if name not in self.specs:
            self.specs[name] = None  # (a cycle of lookups ends here)
            self.specs[name] = self._find(name)
        return self.specs[name]

    def _find(self, name: str) -> importlib.machinery.ModuleSpec | None:
        parent, _, _ = name.rpartition(".")
        try:
            if parent:
                pspec = self.spec(parent)
                locations = None if pspec is None else pspec.submodule_search_locations
                return None if not locations else importlib.machinery.PathFinder.find_spec(name, list(locations))
            found = importlib.machinery.PathFinder.find_spec(name, self.search)
            if found is not None:
                return found
            for finder in sys.meta_path:  # an editable install's finder (the user's own package)
                # (only those: another finder may import what it finds, e.g. setuptools' for distutils)
                if "editable" not in f"{type(finder).__module__}.{getattr(finder, '__name__', type(finder).__name__)}".lower():
                    continue
                found = finder.find_spec(name, None)
                if found is not None:
                    return found
        except Exception:  # a finder that fails on a name: that module is not read
            return None
        return None

    def files(self, name: str) -> list[tuple[str, str, bool]]:
        """(file, dotted name, is a package) of `name` and of the packages it is in, outermost first."""
        parts = name.split(".")
        out = []
        for i in range(1, len(parts) + 1):
            dotted = ".".join(parts[:i])
            s = self.spec(dotted)
            if s is None or (s.origin and s.has_location and is_library(s.origin)):
                break  # (a library's submodules are the library's too)
            if s.origin and s.has_location and s.origin.endswith(".py"):
                out.append((s.origin, dotted, s.submodule_search_locations is not None))
        return out


def _imported(tree: ast.Module, package: str) -> list[str]:
    """The dotted names the module's import statements would import (each `from X import Y`
    also as X.Y: Y may be a submodule), relative ones resolved against `package`."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                if node.level - 1 > len(parts) or not package:
                    continue
                base = ".".join(parts[:len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if not base:
                continue
            names.append(base)
            names.extend(f"{base}.{a.name}" for a in node.names if a.name != "*")
    return names


def module_file(name: str, search: list[str] | None = None) -> str | None:
    """The file `python -m name` would run, found without importing anything; None if there is none."""
    r = _Resolver(search if search is not None else [os.getcwd(), *sys.path[1:]])
    s = r.spec(name)
    if s is not None and s.submodule_search_locations is not None:
        s = r.spec(name + ".__main__")
    return s.origin if s is not None and s.has_location else None


def program_trees(file: str | None, module: str | None = None) -> Iterator[tuple[str, ast.Module | None]]:
    """(file, its syntax tree, None when it cannot be read) of the program's own modules: the
    target file first, then the user's modules it imports, in the order they are reached (see
    module doc). `file` is the target file, or None with `module` the target's dotted module
    name; nothing when neither names a file."""
    root = os.path.dirname(file) if file else os.getcwd()
    resolver = _Resolver([root, *sys.path[1:]])
    if file is None and module:
        file = module_file(module, resolver.search)
    if file is None:
        return
    name = module or ""
    if module and os.path.basename(file) == "__main__.py" and not module.endswith(".__main__"):
        name = module + ".__main__"
    queue = [(os.path.realpath(file), name, False)]
    for outer in (resolver.files(name.rpartition(".")[0]) if "." in name else []):  # -m runs its packages' __init__
        queue.append((os.path.realpath(outer[0]), outer[1], outer[2]))
    seen = {q[0] for q in queue}
    i = 0
    while i < len(queue) and i < MAX_FILES:
        path, dotted, is_package = queue[i]
        i += 1
        tree = _parse(path)
        yield path, tree
        if tree is None:
            continue
        package = dotted if is_package else dotted.rpartition(".")[0]
        for imported in _imported(tree, package):
            for f, d, pkg in resolver.files(imported):
                real = os.path.realpath(f)
                if real not in seen and not is_library(real):
                    seen.add(real)
                    queue.append((real, d, pkg))


def program_reasons(file: str | None, module: str | None = None) -> list[tuple[str, int, str]]:
    """(file, line, what) where the program asks for CUDA: the target file's places first, then
    those of the user's modules it imports, in the order they are reached (see module doc).
    `file` is the target file, or None with `module` the target's dotted module name."""
    return [(path, line, what) for path, tree in program_trees(file, module) if tree is not None
            for line, what in _reasons(tree)]
