"""Every third-party package the auditor imports is declared in pyproject.toml: a plain
`pip install .` (the README's first command) must be enough to run it. (numpy and pandas were once
missing: only the test extras pulled them in, so the suite passed and a user's first audit failed.)"""
from __future__ import annotations

import ast
import re
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from conftest import ROOT

# Imported but not declared, on purpose: torch is the user's own build; yaml is optional (a small
# built-in reader takes over without it).
NOT_DECLARED = {"torch", "yaml"}
# Imported only when asked for (`audit analyze --engine ray|dask`): each declared in its own extra.
OPTIONAL = {"ray": "ray", "dask": "dask"}


def _imported_top_level_names() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "auditor").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "auditor"}


def test_every_imported_package_is_a_declared_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    declared = {re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].strip().lower().replace("-", "_")
                for d in project["dependencies"]}
    imported = _imported_top_level_names()
    assert {"numpy", "pandas", "plotly", "msgspec"} <= imported  # the scan sees the real imports
    assert sorted(imported - NOT_DECLARED - set(OPTIONAL) - declared) == []
    extras = project["optional-dependencies"]
    for package, extra in OPTIONAL.items():
        assert any(d.lower().startswith(package) for d in extras[extra]), (package, extra)
