"""An audit read back in Python (a notebook): `auditor.analyze`, `auditor.run` and `auditor.load`
return an Audit (auditor.api).

An Audit reads its output directory only: findings.json (the contract other tools read: docs/schemas.md),
evidence.json for a run's steps, the patch files. Its findings and steps are pandas DataFrames, built
when first asked for (pandas is imported then, not with auditor); `_repr_html_` shows the report's
first screen, every value from the audit escaped.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from auditor.errors import EXIT_INTERNAL, EXIT_OK, EXIT_TARGET_FAILED, AuditError

if TYPE_CHECKING:
    import pandas as pd

    from auditor.evidence.compare import Comparison
    from auditor.evidence.run_time import RunTime
    from auditor.findings import Finding

FINDINGS_FILE = "findings.json"
FINDING_COLUMNS = ["rule", "severity", "file", "line", "ms_per_step", "share", "message"]
STEP_COLUMNS = ["step", "ms", "host_ms", "device_ms", "cpu_ms", "role", "data_wait_ms", "sync_wait_ms",
                "rss_bytes", "device_allocated_bytes"]


@dataclass(frozen=True)
class Fixes:
    """What the audit proposes, as text to apply: `config`, every finding's config change as the
    report's "Patched config" shows it (shell exports, keyword arguments, settings); `patch`,
    fixes.patch (every code edit; those that change what the training computes are marked in its
    first lines). '' where there is none."""

    config: str
    patch: str


@dataclass(frozen=True)
class Diff:
    """Two audits compared as `audit diff A B` compares them (auditor.diff): `comparison` whole,
    `run_pct` (how much slower (+) or faster (-) B's run's time per step is, in %; None where a
    side has none), `step_pct` (the same of the median step), and its numbers and findings as
    DataFrames."""

    comparison: Comparison

    @property
    def run_pct(self) -> float | None:
        return self.comparison.run_pct

    @property
    def step_pct(self) -> float | None:
        return self.comparison.step_pct

    @property
    def deltas(self) -> pd.DataFrame:
        """A row per compared number: group, name, unit, a, b, change, pct, noise, verdict."""
        return _frame(self.comparison.deltas)

    @property
    def findings(self) -> pd.DataFrame:
        """A row per finding of either side: rule, severity, title, status (gone/new/kept), where,
        cost_a, cost_b, change, verdict, ..."""
        return _frame(self.comparison.findings)


def _frame(records: list) -> pd.DataFrame:
    import msgspec
    import pandas as pd

    return pd.DataFrame(msgspec.to_builtins(records))


class Audit:
    """One audit's outputs in `out` (an absolute path), and the exit code `audit` gave it."""

    def __init__(self, out: Path, document: dict[str, Any], exit_code: int) -> None:
        self.out = out
        self.document = document  # findings.json, as plain data
        self.exit_code = exit_code

    @classmethod
    def read(cls, out: str | Path, exit_code: int | None = None) -> Audit:
        """The audit written in `out`; AuditError (exit 2) when it holds none. Without `exit_code`,
        the one its run's ending gives (3: the target failed; 4: the audit did; else 0)."""
        out = Path(out).resolve()
        try:
            document = json.loads((out / FINDINGS_FILE).read_bytes())
        except FileNotFoundError:
            raise AuditError(f"{out}: not an audit output directory (no {FINDINGS_FILE})") from None
        except (OSError, ValueError) as e:
            raise AuditError(f"{out / FINDINGS_FILE}: not readable ({e})") from None
        if not isinstance(document, dict) or not isinstance(document.get("findings"), list):
            raise AuditError(f"{out / FINDINGS_FILE}: not an auditor findings file")
        return cls(out, document, _ending_code(document) if exit_code is None else exit_code)

    def __repr__(self) -> str:
        return f"<Audit of {self.target!r}: {len(self.document['findings'])} finding(s) in {self.out}>"

    @property
    def target(self) -> str:
        return str(self.document.get("target", ""))

    @property
    def source(self) -> str:
        """What was audited: run, trace, snapshot or checkpoint."""
        return str(self.document.get("source", ""))

    @property
    def paths(self) -> dict[str, Path]:
        """The outputs written in `out`, by file name (report.html, findings.json, findings.sarif,
        evidence.json, summary.txt, the patch files, ...)."""
        return {p.name: p for p in sorted(self.out.iterdir()) if p.is_file() and not p.name.startswith(".")}

    @property
    def report(self) -> Path:
        return self.out / "report.html"

    @cached_property
    def finding_records(self) -> list[Finding]:
        """The findings as the rules returned them (auditor.findings.Finding): evidence, cost, fix."""
        import msgspec

        from auditor.findings import Finding

        try:
            return msgspec.convert(self.document["findings"], list[Finding])
        except msgspec.ValidationError as e:
            raise AuditError(f"{self.out / FINDINGS_FILE}: not an auditor findings file ({e})") from None

    @cached_property
    def findings(self) -> pd.DataFrame:
        """A row per finding: rule, severity, file and line (its first place), ms_per_step (what its
        fix saves), share (of the run's time per step), message."""
        import pandas as pd

        rows = []
        for f in self.finding_records:
            where = f.locations[0] if f.locations else None
            rows.append({"rule": f.rule, "severity": f.severity, "file": where.file if where else None,
                         "line": where.line if where else None,
                         "ms_per_step": f.cost.ms_per_step if f.cost else None,
                         "share": f.cost.share_of_step if f.cost else None, "message": f.message})
        frame = pd.DataFrame(rows, columns=FINDING_COLUMNS)
        return frame.astype({"line": "Int64", "ms_per_step": "float64", "share": "float64"})

    @cached_property
    def steps(self) -> pd.DataFrame:
        """A row per step: its time (ms: on its bound's clock; host_ms, device_ms, cpu_ms), role
        (timed, checked: numerics checked, profiled, failed; a recording's: recorded), its waits for
        data and for the device, and memory at its end. A recording's steps are its ProfilerSteps."""
        import pandas as pd

        rows = _run_steps(self.out) if self.source == "run" else []
        if not rows:
            rows = _recorded_steps(self.document.get("steps") or {})
        kinds = {c: "float64" for c in STEP_COLUMNS if c.endswith("_ms") or c == "ms"}
        return pd.DataFrame(rows, columns=STEP_COLUMNS).astype(
            {**kinds, "step": "Int64", "rss_bytes": "Int64", "device_allocated_bytes": "Int64"})

    @property
    def run_time(self) -> RunTime | None:
        """The run's time account (auditor.evidence.run_time; findings.json's `run_time`): the time
        per step without the audit's own (base_ms) and its parts (work, data, between, syncs, ...)."""
        import msgspec

        from auditor.evidence.run_time import RunTime

        doc = self.document.get("run_time")
        return msgspec.convert(doc, RunTime) if doc else None

    @property
    def fixes(self) -> Fixes:
        from auditor.reports.html import patched_config

        config = "\n\n".join(f"# {g.title}\n{g.text}" for g in patched_config(self.finding_records))
        return Fixes(config, _text(self.out / "fixes.patch"))

    def diff(self, other: Audit | str | Path) -> Diff:
        """This audit (A) against `other` (B: an Audit, an output directory or a trace), as
        `audit diff A B` compares them."""
        return Diff(compare(self.out, other.out if isinstance(other, Audit) else Path(other)))

    def _repr_html_(self) -> str:
        return first_screen(self)


def _ending_code(document: dict[str, Any]) -> int:
    """The exit code a saved run's ending gives (auditor.app.exit_code without --fail-on)."""
    ending = document.get("ending") or {}
    if document.get("source") != "run" or ending.get("status", "completed") in ("completed", "exited"):
        return EXIT_OK
    return EXIT_INTERNAL if ending.get("audit_cause") else EXIT_TARGET_FAILED


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def _run_steps(out: Path) -> list[dict[str, Any]]:
    """A run's steps from its evidence.json (StepRecord), with their roles and waits as the run's
    time account reads them (auditor.evidence.run_time)."""
    from auditor.evidence.model import decode
    from auditor.evidence.run_time import _role, _waits

    try:
        evidence = decode((out / "evidence.json").read_bytes())
    except (OSError, ValueError):
        return []
    rows = []
    for s in evidence.steps:
        data, syncs = _waits(s)
        rows.append({"step": s.index, "ms": s.time_ms, "host_ms": s.ms, "device_ms": s.device_ms, "cpu_ms": s.cpu_ms,
                     "role": _role(s), "data_wait_ms": data, "sync_wait_ms": syncs, "rss_bytes": s.rss_bytes,
                     "device_allocated_bytes": s.device_allocated})
    return rows


def _recorded_steps(steps: dict[str, Any]) -> list[dict[str, Any]]:
    """A recording's steps from findings.json's `steps`: their times on each clock."""
    times = steps.get("per_step_ms") or []
    host, device = steps.get("host_ms") or [], steps.get("device_ms") or []
    numbers = [g.get("step") for g in steps.get("gpu") or []]
    if len(numbers) != len(times):
        numbers = list(range(len(times)))
    return [{"step": n, "ms": ms, "host_ms": host[i] if i < len(host) else None,
             "device_ms": device[i] if i < len(device) else None, "role": "recorded"}
            for i, (n, ms) in enumerate(zip(numbers, times))]


def compare(a: str | Path, b: str | Path) -> Comparison:
    """B against A as `audit diff A B` compares them (auditor.diff.compare_paths): each an output
    directory, a profiler trace or a TensorBoard logdir."""
    from auditor import app
    from auditor.diff import compare_paths
    from auditor.evidence import source_access
    from auditor.evidence.errors import InputError

    a, b = Path(a), Path(b)
    with source_access.kept():
        app.allow_sources((), (a, b))
        config = app.rule_config(Path.cwd(), (), ())
        try:
            return compare_paths(a, b, config)
        except InputError as e:
            raise AuditError(str(e)) from None


SHOWN = 10  # the costliest findings listed (the rest are in Audit.findings)
TITLES = {"checkpoint": "Checkpoint audit", "snapshot": "Memory snapshot audit"}

TEMPLATE = """\
<div class="auditor-audit" style="font-family: sans-serif; line-height: 1.4">
<style>.auditor-audit th, .auditor-audit td { text-align: left; vertical-align: top }</style>
<h3 style="margin: 0.2em 0">{{ title }} <code>{{ target }}</code></h3>
{% if failed %}<p style="color: #b00020"><b>The run {{ ending.status }}</b>
{%- if ending.exception %}: {{ ending.exception }}{% if ending.message %}: {{ ending.message }}{% endif %}{% endif %}</p>{% endif %}
<table>
{% if parts %}<tr><th>Run's time per step</th><td>{{ parts }}</td></tr>{% endif %}
<tr><th>Median step</th><td>{{ median }}</td></tr>
<tr><th>Findings</th><td>{{ counts or "none" }}</td></tr>
</table>
{% if shown %}<table>
<tr><th>severity</th><th>rule</th><th>where</th><th>cost</th><th>message</th></tr>
{% for f in shown %}<tr><td>{{ f.severity }}</td><td><code>{{ f.rule }}</code></td><td>{{ f.where }}</td>
<td>{{ f.cost }}</td><td>{{ f.message }}</td></tr>
{% endfor %}</table>{% if more %}<p>... and {{ more }} more (<code>.findings</code> lists them all)</p>{% endif %}{% endif %}
<p>report: <a href="{{ report_uri }}" target="_blank">{{ report }}</a></p>
</div>
"""


def first_screen(audit: Audit) -> str:
    """The report's first screen, inline: its title, the run's ending when it failed, the run's time
    per step and its parts, the median step, the findings by severity and the costliest SHOWN, a
    link to report.html; in the report's words (auditor.reports), every value escaped (autoescape)."""
    import jinja2

    from auditor.reports.html import cost_text, fmt_ms
    from auditor.reports.run_time_lines import parts_line
    from auditor.reports.terminal import by_cost

    doc = audit.document
    ending = doc.get("ending") or {}
    account = audit.run_time
    findings = audit.finding_records
    counts = ", ".join(f"{n} {s}" for s in ("error", "warning", "info")
                       if (n := sum(f.severity == s for f in findings)))
    shown = [{"severity": f.severity, "rule": f.rule, "cost": cost_text(f), "message": f.message,
              "where": f"{f.locations[0].file}:{f.locations[0].line}" if f.locations else ""}
             for f in by_cost(findings)[:SHOWN]]
    env = jinja2.Environment(autoescape=True)
    return env.from_string(TEMPLATE).render(
        title=TITLES.get(audit.source, "Training-step audit"), target=audit.target,
        failed=audit.source == "run" and ending.get("status", "completed") not in ("completed", "exited"),
        ending=ending, parts=parts_line(account).removeprefix("run's time: ") if account is not None else "",
        median=fmt_ms((doc.get("steps") or {}).get("median_ms")), counts=counts, shown=shown,
        more=max(0, len(findings) - SHOWN), report=audit.report, report_uri=audit.report.as_uri())

