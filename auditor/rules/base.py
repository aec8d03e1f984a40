"""What a rule is and what it returns.

A rule is one small module holding one `Rule` subclass: an id, a title, a default severity, the
kinds of evidence it needs, options with defaults, documentation with fixed headings, and
`check(evidence, options)` returning findings. `audit explain ID`, `audit rules` and the SARIF rule
table all read these same attributes, so the docs cannot drift from the code.
"""
from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from auditor.evidence.model import Evidence
from auditor.findings import Cost, Finding, Fix, Location, step_basis_ms, with_share

# The kinds of evidence a rule can need (Rule.needs): a run (`audit run`, or its saved directory),
# a profiler trace, a CUDA memory snapshot, a checkpoint (`audit checkpoint`).
EVIDENCE_KINDS = ("run", "trace", "snapshot", "checkpoint")


@dataclass(frozen=True)
class Option:
    """A tunable threshold. Users set it in `[tool.auditor.rules.<rule-id>]` of pyproject.toml.

    A number outside `bounds()` is refused when the config loads: `min-share-of-steps = 1.5` or a
    negative count would otherwise turn a rule off (or crash it) without a word."""

    name: str
    default: Any
    help: str
    low: float | None = None  # None: the default bounds (see bounds()); high=inf: no upper bound
    high: float | None = None

    def bounds(self) -> tuple[float | None, float | None]:
        """(low, high) a numeric value must lie within (None: open). Unless the option sets its
        own: a share or correlation lies in [0, 1], any other number (a count, a threshold in ms,
        MiB or a ratio) is >= 0. Options that are not numbers have none."""
        if isinstance(self.default, bool) or not isinstance(self.default, (int, float)):
            return None, None
        if "share" in self.name or "correlation" in self.name:
            low, high = 0.0, 1.0
        else:
            low, high = 0.0, None
        if self.low is not None:
            low = self.low
        if self.high is not None:
            high = None if self.high == float("inf") else self.high
        return low, high

    def typed(self, value: Any) -> Any:
        """`value` as this option holds it: a whole number given for an option whose default is a
        float becomes a float (config validation has refused values of another kind)."""
        if isinstance(self.default, float) and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        return value


class Options(Mapping[str, Any]):
    """The values of a rule's declared options, each the value the config gives it (see
    Option.typed) or else its default: read them as attributes, the name with `_` for `-`
    (`options.min_share`), or by name (`options["min-share"]`). An option the rule does not
    declare is an error, never a default."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):
            raise AttributeError(attr)
        try:
            return self._values[attr.replace("_", "-")]
        except KeyError:
            raise AttributeError(f"no option {attr.replace('_', '-')!r} (options: "
                                 f"{', '.join(self._values) or 'none'})") from None

    def __setattr__(self, attr: str, value: Any) -> None:
        raise AttributeError("options are read-only")

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Options({self._values!r})"


class Rule:
    """Base class of every rule. Subclasses set the class attributes and implement `check`.

    `needs` names the kinds of evidence (EVIDENCE_KINDS) the rule judges: the engine runs it when
    the evidence holds any of them (none named: on any evidence) and otherwise reports it skipped,
    in its own words for those kinds (`needs_text` replaces them where the rule reads something
    more particular from them). `skip_reason` is the hook for what else a rule needs of evidence of
    the right kind (numerics, a distributed run, two graph scans).

    The class docstring is the rule's documentation and uses the headings
    What it detects / Why it costs / Example / Fix / Evidence needed.
    """

    id: ClassVar[str]
    title: ClassVar[str]
    severity: ClassVar[str] = "warning"
    # The clock its fix shortens (auditor.findings.saving_on_path): "host" (the host's issue time),
    # "device" (the device's kernels), "step" (a cost that is already the step's own time)
    saves_on: ClassVar[str] = "host"
    category: ClassVar[str] = "performance"
    # Why a performance warning of this rule stays a warning when its cost is not timed (counted
    # only), in words a user can act on; empty: such a finding is info (auditor.rules.engine.graded)
    warns_uncounted: ClassVar[str] = ""
    needs: ClassVar[frozenset[str]] = frozenset()
    needs_text: ClassVar[str | None] = None  # the skip reason when none of `needs` is present
    options: ClassVar[tuple[Option, ...]] = ()
    # Derived evidence the rule makes once per trace and other rules read too (a trace's gap
    # table): rules that share one are judged in the same process when the rules are split over
    # two (auditor.rules.forked), so it is made once.
    shares: ClassVar[tuple[str, ...]] = ()
    # What of a trace's events the rule reads beyond their names and times, as torch.profiler's
    # options that record it: "record_shapes" (operators' input shapes), "with_stack" (Python
    # frames). An audit whose profiler window dropped one to fit its memory bound (evidence.profile.drop)
    # says the rule judged its trace without it (auditor.reports.window_drop).
    reads: ClassVar[frozenset[str]] = frozenset()

    def skip_reason(self, evidence: Evidence) -> str | None:
        """Why evidence of a kind this rule needs still cannot answer it (None: it can)."""
        return None

    def check(self, evidence: Evidence, options: Options) -> Iterable[Finding]:
        raise NotImplementedError

    def check_trace(self, trace: Any, options: Options) -> Finding | None:
        """One finding or None for one recorded trace (see `trace_findings`). Its cost's share is
        set by `trace_findings`, of the step the evidence states (`step_basis_ms`), which a trace
        alone does not know: a run's median step."""
        raise NotImplementedError

    # True: `check_trace(trace, options, chosen)` also takes the device `--device` chose ("" when
    # none: the trace's own deviceProperties pick the device model's row)
    judged_on_device: ClassVar[bool] = False

    def trace_findings(self, evidence: Evidence, options: Options) -> Iterator[Finding]:
        """`check_trace` on each recorded trace (`evidence.trace_data`) in turn, with its cost's share."""
        for trace in evidence.trace_data:
            finding = (self.check_trace(trace, options, evidence.environment.device_model) if self.judged_on_device
                       else self.check_trace(trace, options))
            if finding is not None:
                yield with_share(finding, step_basis_ms(evidence, trace))

    # Helpers for subclasses.
    @classmethod
    def docs(cls) -> str:
        return inspect.cleandoc(cls.__doc__ or "")

    @classmethod
    def explanation(cls) -> str:
        """What `audit explain ID` prints, and the rules reference of the documentation site shows:
        the id, title, severity and category, the docstring, then the options with their defaults."""
        text = f"{cls.id}: {cls.title}\nseverity: {cls.severity}    category: {cls.category}\n\n{cls.docs()}\n"
        if cls.options:
            text += f"\nOptions ([tool.auditor.rules.{cls.id}] in pyproject.toml):\n"
            text += "".join(f"    {o.name} = {o.default!r}    {o.help}\n" for o in cls.options)
        return text

    @classmethod
    def default_options(cls) -> Options:
        return cls.options_with({})

    @classmethod
    def options_with(cls, values: Mapping[str, Any]) -> Options:
        """The declared options with `values` (by name) in place of their defaults. A name the rule
        does not declare is a KeyError (the config reports it to the user first)."""
        declared = {o.name: o for o in cls.options}
        unknown = set(values) - set(declared)
        if unknown:
            raise KeyError(f"unknown option(s) for rule {cls.id}: {', '.join(sorted(unknown))}")
        return Options({name: o.typed(values[name]) if name in values else o.default
                        for name, o in declared.items()})

    def finding(self, message: str, *, severity: str | None = None, title: str | None = None,
                locations: Iterable[Location] = (), evidence: dict[str, Any] | None = None,
                cost: Cost | None = None, fix: Fix | None = None) -> Finding:
        return Finding(rule=self.id, severity=severity or self.severity, title=title or self.title,
                       message=message, locations=list(locations), evidence=evidence or {},
                       cost=cost, fix=fix)


class TraceRule(Rule):
    """A rule judged on each recorded profiler trace in turn (`evidence.trace_data`).

    Subclasses implement `check_trace(trace, options)`, returning one finding or None."""

    needs = frozenset({"trace"})

    def check(self, evidence: Evidence, options: Options) -> Iterable[Finding]:
        return self.trace_findings(evidence, options)


class SnapshotRule(Rule):
    """A rule judged on each device of each CUDA memory snapshot (`evidence.snapshot_data`).

    Subclasses implement `check_device(snapshot, device, options)`, yielding findings."""

    needs = frozenset({"snapshot"})

    def check(self, evidence: Evidence, options: Options) -> Iterable[Finding]:
        for snap in evidence.snapshot_data:
            for device in snap.devices:
                yield from self.check_device(snap, device, options)

    def check_device(self, snap: Any, device: int, options: Options) -> Iterable[Finding]:
        raise NotImplementedError
