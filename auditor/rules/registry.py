"""The rule registry: every rule, built-in or third-party, arrives through the `auditor.rules`
entry-point group, so the mechanism plugins use is the one the built-ins exercise every run."""
from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache
from importlib.metadata import entry_points

from auditor.rules.base import EVIDENCE_KINDS, Rule

GROUP = "auditor.rules"

# Modules of auditor.rules that hold no rule; every other one holds one, named by its id.
NOT_RULES = frozenset({"base", "engine", "registry", "suppression"})


def builtin_rules() -> tuple[str, ...]:
    """"module:Class" of every rule in this package: the Rule subclass each module of auditor.rules
    (but NOT_RULES and the _private ones) defines. The entry points pyproject.toml declares are
    these (a test holds them equal); they stand in for them when the package metadata is missing
    (a source tree run without installing)."""
    import auditor.rules as package

    specs = []
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_") or info.name in NOT_RULES:
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        specs += [f"{module.__name__}:{name}" for name, obj in vars(module).items()
                  if isinstance(obj, type) and issubclass(obj, Rule) and obj.__module__ == module.__name__
                  and "id" in vars(obj)]
    return tuple(specs)


def _load(spec: str) -> type[Rule]:
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


@lru_cache(maxsize=1)
def all_rules() -> dict[str, type[Rule]]:
    """Rule id -> rule class, in id order."""
    found: dict[str, type[Rule]] = {}
    eps = entry_points(group=GROUP)
    if not any(ep.value.startswith("auditor.") for ep in eps):
        for spec in builtin_rules():
            cls = _load(spec)
            found[cls.id] = cls
    for ep in eps:
        cls = ep.load()
        if not (isinstance(cls, type) and issubclass(cls, Rule)):
            raise TypeError(f"entry point {ep.name!r} in {GROUP} is not an auditor Rule: {cls!r}")
        if not cls.needs <= set(EVIDENCE_KINDS):
            raise TypeError(f"rule {cls.id!r} needs {sorted(cls.needs)}: the kinds of evidence are {EVIDENCE_KINDS}")
        found[cls.id] = cls
    return dict(sorted(found.items()))


@lru_cache(maxsize=1)
def rule_ids() -> frozenset[str]:
    """Every rule id, without importing the rules (config validation needs no more)."""
    eps = entry_points(group=GROUP)
    if not any(ep.value.startswith("auditor.") for ep in eps):
        return frozenset(all_rules())
    return frozenset(ep.name for ep in eps)


def get_rule(rule_id: str) -> type[Rule] | None:
    return all_rules().get(rule_id)
