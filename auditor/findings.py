"""What the rules return and every report renders: findings, their places, costs and fixes.

A Finding crosses from the rules to the reports (and to findings.json, whose keys the README documents
as a contract), so it lives below both. Nothing here imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from auditor.evidence.model import Evidence
from auditor.evidence.frame import Frame

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
    """The run's time per step every cost's share is of (auditor.evidence.run_time: the span from
    the first step's start to the last one's end, the audit's own work left out, over the steps;
    findings.json's `run_time.base_ms`), also for a finding on the run's own profiler trace; for a
    recording (analysed on its own, or given beside a run), its steps on their bound's clock and the
    time between them, over their number (auditor.evidence.run_time.trace_base_ms)."""
    from auditor.evidence.run_time import own_trace, run_time, trace_base_ms

    if trace is None or (ev.steps and own_trace(ev, trace)):
        account = run_time(ev)
        return account.base_ms if account is not None else ev.shown_median_ms()
    return trace_base_ms(trace)


def share_of_step(ms_per_step: float | None, step_ms: float | None) -> float | None:
    """A cost's share of the run's time: the one percentage every report prints for it (the
    finding's message, the terminal line, report.html, findings.json, the headline's sum). Its ms
    per step, as the cost stores it, over the run's time per step as findings.json writes it (3
    decimals, step_basis_ms), to 4 decimals: `ms_per_step / run_time.base_ms` there gives it back.
    A stall in one step in eight counts an eighth of it per step."""
    if ms_per_step is None or not step_ms:
        return None
    return round(ms_per_step / round(step_ms, 3), 4)


# Which clock a fix shortens (Rule.saves_on): the host's issue time ("host": fewer syncs, waits,
# launches, Python), the device's work ("device": faster kernels), or the step as a whole ("step":
# a slowdown, a straggler, whose cost is already the step's time).
HOST, DEVICE, STEP = "host", "device", "step"


def saving_on_path(ms: float, side: str, bound: str | None, host_ms: float | None, device_ms: float | None,
                   device_busy_ms: float | None, waited_ms: float | None = None) -> float:
    """What a saving of `ms` per step on `side` takes off the step's critical path (its bound's
    clock, auditor.evidence.step_clock): on a host-bound step, a host-side saving counts in full
    up to the step less the device's own work (busy time, which no host-side fix removes), a
    device-side one only as far as the host waits for the device's work (`waited_ms`: the device's
    work inside the host's syncs per step, from a trace; faster kernels shorten the host's time
    only there, and not at all where it never waits), as measured where that is not known; on a
    device-bound step, a host-side saving counts only by what the host's time exceeds the device's
    (nothing while the device stays the longer), a device-side one up to the device's time less the
    host's, the host's time without its waits for the device (issue_ms: a step that issues, then
    waits in a sync). No bound known (no device clock), or a whole-step cost: the saving as measured."""
    if bound is None or side == STEP or host_ms is None:
        return ms
    if bound == "host":
        if side == DEVICE:
            return ms if waited_ms is None else max(0.0, min(ms, waited_ms))
        return max(0.0, min(ms, host_ms - (device_busy_ms or 0.0)))
    if device_ms is None:
        return ms
    issue = issue_ms(host_ms, device_ms, waited_ms)
    if side == HOST:
        return max(0.0, min(ms, issue - device_ms))
    return max(0.0, min(ms, device_ms - issue))


def issue_ms(host_ms: float, device_ms: float | None, waited_ms: float | None) -> float:
    """A device-bound step's host time without its waits for the device: the host's clock where the
    device's exceeds it (the host ran ahead), else the host's clock less the device work it waited
    for in its syncs (a step that issues, then waits for the device to finish)."""
    if device_ms is None or waited_ms is None or device_ms > host_ms:
        return host_ms
    return max(0.0, host_ms - waited_ms)


def together_ms(host_saving: float, device_saving: float, step_saving: float, step_ms: float | None,
                bound: str | None, host_ms: float | None, device_ms: float | None,
                device_busy_ms: float | None, waited_ms: float | None = None) -> float:
    """What fixes together save per step: the step on its bound's clock before, less the step after
    every host-side saving is taken off the host's clock and every device-side one off the device's
    (the longer clock again the step), less whole-step savings; never below the device's own work
    on a host-bound step, never below nothing. On a host-bound step the device-side savings shorten
    the host's clock only as far as it waits for the device (`waited_ms`, see saving_on_path). With
    no bound known, their sum up to the step."""
    if step_ms is None:
        return host_saving + device_saving + step_saving
    if bound is None or host_ms is None:
        return min(step_ms, host_saving + device_saving + step_saving)
    if bound == "host":
        waits = device_saving if waited_ms is None else min(device_saving, waited_ms)
        host, device = host_ms, device_busy_ms or 0.0
        host_after = max(host - host_saving - waits, 0.0)
    else:
        host, device = issue_ms(host_ms, device_ms, waited_ms), device_ms or 0.0
        host_after = max(host - host_saving, 0.0)
    device_after = max(device - device_saving, 0.0)
    # (the longer clock before, less the longer after: a step that waits for its device past the
    # device's busy time saves nothing by that wait unless a fix shortens it)
    return max(0.0, min(step_ms, max(host, device) - max(host_after, device_after) + step_saving))


class Edit(msgspec.Struct, frozen=True):
    """Replace lines [start, end] (1-based, inclusive) of `file` with `lines` (without newlines)."""

    file: str
    start: int
    end: int
    lines: list[str]


class Verified(msgspec.Struct, frozen=True):
    """What `audit run --verify` measured for a fix (auditor.verify): the program re-run with it applied.

    status: "improved" (its finding is gone, or its cost fell by a quarter or more), "no-change"
      (the finding is still there), "failed" (the patch did not apply or the patched program
      failed), "changed-results" (a fix that keeps results: the weights after the audited steps
      differ from the unpatched run's, which a second unpatched run reproduces). Anything but
      "improved" keeps the fix out of fixes.patch.
    before, after: what the finding measured in the audited run and in the re-run: "finding"
      (whether it was reported), "median_step_ms", "run_step_ms" (the run's time per step),
      "ms_per_step" (its cost), its evidence numbers
      (syncs_per_step, bytes_per_step, nodes_per_step, ...), "weights" (the digest, fixes that keep results).
    note: how it was run and what was seen, in words."""

    status: str
    before: dict[str, Any] = {}
    after: dict[str, Any] = {}
    note: str = ""


class Fix(msgspec.Struct, frozen=True):
    summary: str
    config: dict[str, Any] = {}  # env vars, DataLoader/optimizer keywords, flags to turn off
    patch: str | None = None  # unified diff of `edits`, for `git apply`
    edits: list[Edit] = []
    changes_numerics: bool = False  # marked for review in fixes.patch; --verify runs it apart
    verified: Verified | None = None  # what `audit run --verify` measured (None: not verified)


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


@dataclass
class RuleResults:
    findings: list[Finding] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)  # [{"rule", "reason"}]
    errors: list[dict[str, str]] = field(default_factory=list)  # a rule that crashed: [{"rule", "error"}]
    suppressed: int = 0


def rank_key(f: Finding) -> tuple:
    """Most severe first, then most costly."""
    cost = f.cost.ms_per_step if f.cost and f.cost.ms_per_step is not None else -1.0
    share = f.cost.share_of_step if f.cost and f.cost.share_of_step is not None else -1.0
    return (-severity_rank(f.severity), -cost, -share, f.rule)
