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

import msgspec

from auditor.evidence.model import Evidence, Frame

SEVERITIES = ("info", "warning", "error")


def severity_rank(severity: str) -> int:
    return SEVERITIES.index(severity)


class Location(msgspec.Struct, frozen=True):
    file: str
    line: int
    code: str = ""  # the source line, when the file is on this disk; nothing else
    # What the place stands for when it is not the line that did the work: a recorded trace names a
    # function by its def line, or a frame running when the profiler started by the line it was on.
    # Kept apart from `code` so that no report shows it as if it were that line's source.
    note: str = ""

    @classmethod
    def of(cls, frame: Frame) -> "Location":
        return cls(file=frame.file, line=frame.line, code=frame.code)


class Cost(msgspec.Struct, frozen=True):
    ms_per_step: float | None
    share_of_step: float | None
    measured: bool = True  # False: estimated, or counted only (e.g. syncs on a CPU-only run)
    note: str | None = None
    # The id of the rule whose finding on the same recording (same evidence "trace") counts this
    # time in its own cost: host-sync's idle time behind the waits is part of gpu-idle's idle
    # total. The headline's recoverable sum then counts it once (reports.terminal.recoverable);
    # the cost itself stays what it measures.
    within: str | None = None


def step_basis_ms(ev: Evidence, trace: Any = None) -> float | None:
    """The median step a cost's share is of: the run's (findings.json's `steps.median_ms`, the
    headline's median), also for a finding on the run's own profiler trace; for a recording
    analysed on its own, its trace's median ProfilerStep (the first trace's is `steps.median_ms`)."""
    if ev.steps or trace is None:
        return ev.shown_median_ms()
    return trace.median_step_ms()


def share_of_step(ms_per_step: float | None, step_ms: float | None) -> float | None:
    """A cost's share of the step: the one percentage every report prints for it (the finding's
    message, the terminal line, report.html, findings.json, the headline's sum). Its ms per step,
    as the cost stores it, over the median step as findings.json writes it (3 decimals), to 4
    decimals: `ms_per_step / steps.median_ms` there gives it back. (A median of per-step shares
    printed beside it read 61% where ms/median read 57%, for one cost.)"""
    if ms_per_step is None or not step_ms:
        return None
    return round(ms_per_step / round(step_ms, 3), 4)


class Edit(msgspec.Struct, frozen=True):
    """Replace lines [start, end] (1-based, inclusive) of `file` with `lines` (without newlines)."""

    file: str
    start: int
    end: int
    lines: list[str]


class Fix(msgspec.Struct, frozen=True):
    summary: str
    config: dict[str, Any] = {}  # env vars, DataLoader/optimizer keywords, flags to turn off
    patch: str | None = None  # unified diff of `edits`, for `git apply`
    edits: list[Edit] = []
    changes_numerics: bool = False  # such edits stay out of fixes.patch unless asked for


class Finding(msgspec.Struct, frozen=True):
    rule: str
    severity: str
    title: str
    message: str
    locations: list[Location] = []
    evidence: dict[str, Any] = {}
    cost: Cost | None = None
    fix: Fix | None = None


def with_share(finding: Finding, step_ms: float | None) -> Finding:
    """`finding` with its time cost's share of `step_ms` (see share_of_step)."""
    c = finding.cost
    if c is None or c.ms_per_step is None:
        return finding
    return msgspec.structs.replace(finding, cost=msgspec.structs.replace(
        c, share_of_step=share_of_step(c.ms_per_step, step_ms)))


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
