"""User configuration: `[tool.auditor]` in pyproject.toml plus command-line --select/--ignore.

    [tool.auditor]
    select = ["host-sync", "dataloader-bound"]   # only these rules (default: all)
    ignore = ["step-slowdown"]                    # never these
    fail-on = "warning"                           # default for --fail-on

    [tool.auditor.rules.dataloader-bound]
    min-share = 0.25                              # a rule's option (see `audit explain RULE`)

Anything else (an unknown key, rule id or option name; an option value of the wrong type or out of
its range: see Option.bounds) is a usage error, not skipped: a misspelled
setting must not look set. The command line wins: --select replaces the file's select and runs the
rules it names even if the file's ignore lists them; --ignore adds to the file's ignore.
"""
from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from auditor.rules.base import Options, Rule

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

    def options_for(self, rule_cls: type[Rule]) -> Options:
        """The rule's options: its declared defaults with the values this config gives them, each of
        its default's kind and within its bounds (anything else is a ConfigError)."""
        declared = {o.name: o for o in rule_cls.options}
        given = self.rule_options.get(rule_cls.id, {})
        unknown = set(given) - set(declared)
        if unknown:
            raise ConfigError(f"{self.source}: unknown option(s) for rule {rule_cls.id}: "
                              f"{', '.join(sorted(unknown))} (known: {', '.join(sorted(declared)) or 'none'})")
        for name, value in given.items():
            if not _same_kind(value, declared[name].default):
                raise ConfigError(f"{self.source}: option {name} of rule {rule_cls.id} must be "
                                  f"{_kind(declared[name].default)}, not {value!r}")
        for option in rule_cls.options:
            if option.name in given and (where := _out_of_range(given[option.name], *option.bounds())):
                raise ConfigError(f"{self.source}: option {option.name} of rule {rule_cls.id} must be "
                                  f"{where}, not {given[option.name]!r}")
        return rule_cls.options_with(given)


def _out_of_range(value: Any, low: float | None, high: float | None) -> str | None:
    """What a number outside [low, high] must be instead ("between 0 and 1", ">= 1"); None when
    it is inside (or not a number: those options have no bounds)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if (low is not None and value < low) or (high is not None and value > high) or value != value:
        if low is not None and high is not None:
            return f"between {low:g} and {high:g}"
        return f">= {low:g}" if low is not None else f"<= {high:g}"
    return None


def _kind(default: Any) -> str:
    return ("true or false" if isinstance(default, bool) else "a number" if isinstance(default, (int, float))
            else "a string" if isinstance(default, str) else "a list" if isinstance(default, list)
            else type(default).__name__)


def _same_kind(value: Any, default: Any) -> bool:
    """Whether an option's value has the type of its default (an int where a float is expected is
    fine; a bool is not a number). A default of None takes anything."""
    if default is None:
        return True
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float))
    return isinstance(value, type(default))


def _ids(items: Any) -> set[str]:
    """Rule ids from strings that may each hold several, comma-separated."""
    return {r.strip() for item in items for r in item.split(",") if r.strip()}


def _names(value: Any, key: str, where: str) -> set[str]:
    """A list of rule ids from the file (a list of strings, or one comma-separated string)."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: {key} must be a list of rule ids, not {value!r}")
    return _ids(value)


def _cli_names(items: tuple[str, ...], flag: str) -> set[str]:
    names = _ids(items)
    if not names:  # `--select ""` (an empty $RULES in a CI script) must not turn every rule off
        raise ConfigError(f"{flag}: no rule id given")
    return names


KEYS = ("select", "ignore", "fail-on", "rules")  # of [tool.auditor]; rule options go in [tool.auditor.rules.ID]


def _check_keys(table: dict[str, Any], where: str, known_rules: frozenset[str]) -> None:
    """Refuse keys of [tool.auditor] that mean nothing: a misspelled `fail_on` or `ignored` would
    otherwise be skipped without a word, turning a CI gate or an exclusion off while looking set."""
    for key in table:
        if key in KEYS:
            continue
        if key in known_rules:  # [tool.auditor.host-sync] for [tool.auditor.rules.host-sync]
            hint = f" (did you mean [tool.auditor.rules.{key}]?)"
        elif close := ([k for k in KEYS if k == key.replace("_", "-")]
                       or difflib.get_close_matches(key, KEYS, n=1, cutoff=0.6)):
            hint = f" (did you mean {close[0]!r}?)"
        else:
            hint = f" (known: {', '.join(sorted(KEYS))})"
        raise ConfigError(f"{where}: unknown key {key!r} in [tool.auditor]{hint}")


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
            tool = data.get("tool", {})
            if isinstance(tool, dict) and "auditor" in tool:
                if not isinstance(tool["auditor"], dict):
                    raise ConfigError(f"{candidate}: [tool.auditor] must be a table")
                return candidate
    return None


def load_config(start: Path | None, select: tuple[str, ...] = (), ignore: tuple[str, ...] = ()) -> Config:
    """Config from the nearest pyproject.toml above `start`, overridden by command-line lists."""
    from auditor.rules.registry import get_rule, rule_ids

    cfg = Config()
    path = find_pyproject(start) if start is not None else None
    if path is not None:
        table = tomllib.loads(path.read_text())["tool"]["auditor"]
        cfg.source = where = str(path)
        _check_keys(table, where, rule_ids())
        if "select" in table:
            cfg.select = _names(table["select"], "select", where)
        cfg.ignore = _names(table.get("ignore", []), "ignore", where)
        cfg.fail_on = table.get("fail-on")
        rules = table.get("rules", {})
        if not isinstance(rules, dict) or not all(isinstance(v, dict) for v in rules.values()):
            raise ConfigError(f"{where}: rules must be tables, as [tool.auditor.rules.RULE-ID]")
        cfg.rule_options = {k: dict(v) for k, v in rules.items()}
    if select:
        cfg.select = _cli_names(select, "--select")
        # a rule named on the command line runs even if the file ignores it: the flag is the
        # nearer, later wish (the file's select it replaces outright)
        cfg.ignore -= cfg.select
    if ignore:
        cfg.ignore |= _cli_names(ignore, "--ignore")
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
