"""User configuration: `[tool.auditor]` in pyproject.toml plus command-line --select/--ignore.

    [tool.auditor]
    select = ["host-sync", "dataloader-bound"]   # only these rules (default: all)
    ignore = ["step-slowdown"]                    # never these
    fail-on = "warning"                           # default for --fail-on

    [tool.auditor.rules.dataloader-bound]
    min-share = 0.25                              # a rule's option (see `audit explain RULE`)
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(Exception):
    """A configuration the user must fix; the CLI prints it as one line and exits 2."""


@dataclass
class Config:
    select: set[str] | None = None
    ignore: set[str] = field(default_factory=set)
    fail_on: str | None = None
    rule_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    source: str | None = None  # the pyproject.toml it came from

    def enabled(self, rule_id: str) -> bool:
        return (self.select is None or rule_id in self.select) and rule_id not in self.ignore

    def options_for(self, rule_cls) -> dict[str, Any]:
        opts = rule_cls.default_options()
        given = self.rule_options.get(rule_cls.id, {})
        unknown = set(given) - set(opts)
        if unknown:
            raise ConfigError(f"{self.source}: unknown option(s) for rule {rule_cls.id}: "
                              f"{', '.join(sorted(unknown))} (known: {', '.join(sorted(opts)) or 'none'})")
        opts.update(given)
        return opts


def find_pyproject(start: Path) -> Path | None:
    """The nearest pyproject.toml with a [tool.auditor] table, from `start` upwards."""
    start = start.resolve()
    for d in [start, *start.parents] if start.is_dir() else [start.parent, *start.parent.parents]:
        candidate = d / "pyproject.toml"
        if candidate.is_file():
            try:
                data = tomllib.loads(candidate.read_text())
            except (tomllib.TOMLDecodeError, OSError) as e:
                raise ConfigError(f"{candidate}: not valid TOML: {e}") from None
            if "auditor" in data.get("tool", {}):
                return candidate
    return None


def load_config(start: Path | None, select: tuple[str, ...] = (), ignore: tuple[str, ...] = ()) -> Config:
    """Config from the nearest pyproject.toml above `start`, overridden by command-line lists."""
    from auditor.rules.registry import get_rule, rule_ids

    cfg = Config()
    path = find_pyproject(start) if start is not None else None
    if path is not None:
        table = tomllib.loads(path.read_text())["tool"]["auditor"]
        cfg.source = str(path)
        if "select" in table:
            cfg.select = set(table["select"])
        cfg.ignore = set(table.get("ignore", []))
        cfg.fail_on = table.get("fail-on")
        cfg.rule_options = {k: dict(v) for k, v in table.get("rules", {}).items()}
    if select:
        cfg.select = {r for item in select for r in item.split(",") if r}
    if ignore:
        cfg.ignore |= {r for item in ignore for r in item.split(",") if r}
    known = rule_ids()
    for name in (cfg.select or set()) | cfg.ignore | set(cfg.rule_options):
        if name not in known:
            where = cfg.source or "command line"
            raise ConfigError(f"{where}: unknown rule id {name!r} (see `audit rules`)")
    for rule_id in cfg.rule_options:
        cfg.options_for(get_rule(rule_id))  # unknown option names fail now, before any run
    if cfg.fail_on is not None and cfg.fail_on not in ("info", "warning", "error"):
        raise ConfigError(f"{cfg.source}: fail-on must be info, warning or error, not {cfg.fail_on!r}")
    return cfg
