"""The rule registry: the built-in rules are the entry points, pyproject's and the installed
package's, and each lives in the module named by its id."""
from __future__ import annotations

import sys
from importlib.metadata import entry_points

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from conftest import ROOT

from auditor.rules.base import EVIDENCE_KINDS
from auditor.rules.registry import GROUP, all_rules, builtin_rules, rule_ids


def _pyproject_entry_points() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return project["entry-points"][GROUP]


def test_builtin_rules_are_the_entry_points() -> None:
    declared = _pyproject_entry_points()
    assert sorted(builtin_rules()) == sorted(declared.values())
    installed = {ep.name: ep.value for ep in entry_points(group=GROUP) if ep.value.startswith("auditor.")}
    assert installed == declared  # (a stale install: `pip install -e .` again)


def test_each_rule_lives_in_the_module_named_by_its_id() -> None:
    for spec in builtin_rules():
        module, _, _ = spec.partition(":")
        [cls] = [c for c in all_rules().values() if f"{c.__module__}:{c.__name__}" == spec]
        assert module == "auditor.rules." + cls.id.replace("-", "_")
        assert _pyproject_entry_points()[cls.id] == spec


def test_the_registry_without_package_metadata(monkeypatch) -> None:
    """A source tree run without installing finds every built-in rule all the same."""
    from auditor.rules import registry

    monkeypatch.setattr(registry, "entry_points", lambda group: [])
    all_rules.cache_clear()
    rule_ids.cache_clear()
    try:
        assert set(registry.all_rules()) == set(_pyproject_entry_points())
        assert registry.rule_ids() == frozenset(_pyproject_entry_points())
    finally:
        all_rules.cache_clear()
        rule_ids.cache_clear()


def test_needs_name_kinds_of_evidence() -> None:
    for cls in all_rules().values():
        assert cls.needs <= set(EVIDENCE_KINDS), cls.id
