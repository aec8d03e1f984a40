"""What a rule is and what it returns.

A rule is one small module holding one `Rule` subclass: an id, a title, a default severity, options
with defaults, documentation with fixed headings, and `check(evidence, options)` returning findings.
`audit explain ID`, `audit rules` and the SARIF rule table all read these same attributes, so the
docs cannot drift from the code.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable


from auditor.evidence.model import Evidence
from auditor.findings import Cost, Finding, Fix, Location, step_basis_ms, with_share


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


class Rule:
    """Base class of every rule. Subclasses set the class attributes and implement `check`.

    The class docstring is the rule's documentation and uses the headings
    What it detects / Why it costs / Example / Fix / Evidence needed.
    """

    id: ClassVar[str]
    title: ClassVar[str]
    severity: ClassVar[str] = "warning"
    category: ClassVar[str] = "performance"
    options: ClassVar[tuple[Option, ...]] = ()

    def skip_reason(self, evidence: Evidence) -> str | None:
        """Why the evidence cannot answer this rule (None: it can). The engine reports skips."""
        return None

    def check(self, evidence: Evidence, options: dict[str, Any]) -> Iterable[Finding]:
        raise NotImplementedError

    # Helpers for subclasses.
    @classmethod
    def docs(cls) -> str:
        return inspect.cleandoc(cls.__doc__ or "")

    @classmethod
    def default_options(cls) -> dict[str, Any]:
        return {o.name: o.default for o in cls.options}

    @classmethod
    def options_with(cls, values: dict[str, Any]) -> dict[str, Any]:
        return {**cls.default_options(), **values}

    def finding(self, message: str, *, severity: str | None = None, title: str | None = None,
                locations: Iterable[Location] = (), evidence: dict[str, Any] | None = None,
                cost: Cost | None = None, fix: Fix | None = None) -> Finding:
        return Finding(rule=self.id, severity=severity or self.severity, title=title or self.title,
                       message=message, locations=list(locations), evidence=evidence or {},
                       cost=cost, fix=fix)


class TraceRule(Rule):
    """A rule judged on each recorded profiler trace in turn (`evidence.trace_data`).

    Subclasses implement `check_trace(trace, options)`, returning one finding or None."""

    def skip_reason(self, evidence: Evidence) -> str | None:
        return None if evidence.trace_data else "needs a profiler trace with CUDA activity"

    def check(self, evidence: Evidence, options: dict[str, Any]) -> Iterable[Finding]:
        for trace in evidence.trace_data:
            finding = self.check_trace(trace, options)
            if finding is not None:
                yield with_share(finding, step_basis_ms(evidence, trace))

    def check_trace(self, trace: Any, options: dict[str, Any]) -> Finding | None:
        """One finding or None. Its cost's share is set by `check`, of the step the evidence
        states (`step_basis_ms`), which a trace alone does not know: a run's median step."""
        raise NotImplementedError



class SnapshotRule(Rule):
    """A rule judged on each device of each CUDA memory snapshot (`evidence.snapshot_data`).

    Subclasses implement `check_device(snapshot, device, options)`, yielding findings."""

    def skip_reason(self, evidence: Evidence) -> str | None:
        if not evidence.snapshot_data:
            return "needs a CUDA memory snapshot (torch.cuda.memory._dump_snapshot pickle)"
        return None

    def check(self, evidence: Evidence, options: dict[str, Any]) -> Iterable[Finding]:
        for snap in evidence.snapshot_data:
            for device in snap.devices:
                yield from self.check_device(snap, device, options)

    def check_device(self, snap: Any, device: int, options: dict[str, Any]) -> Iterable[Finding]:
        raise NotImplementedError
