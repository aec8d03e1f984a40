"""What the reports quote of a source file that changed since the run (auditor.evidence.sources).

The findings' quoted code (`Location.code`) is the recorded line, not the edited file's; each
changed file gets a note, shown in the terminal and in report.html, and the terminal lists each
quoted line that differs now, recorded and current side by side.
"""
from __future__ import annotations

import msgspec

from auditor.evidence import sources
from auditor.evidence.model import Evidence, add_load_note
from auditor.findings import RuleResults

CONTEXT_LINES = 3  # source lines quoted above and below a finding's line (report.html's context)


def record_quoted(evidence: Evidence, results: RuleResults) -> bool:
    """Record the sources this render quotes (each finding's place and its context, each recorded
    frame) in `evidence.sources`; whether anything was added (the caller saves the evidence then)."""
    places = {(loc.file, loc.line) for f in results.findings for loc in f.locations}
    added = sources.record(evidence, places, CONTEXT_LINES)
    return sources.record(evidence, sources.frames(evidence)) or added


def changed_note(file: str, now: str | None) -> str:
    return (f"{file} changed since the run (sha256 differs): the code quoted is as the run read it"
            if now else f"{file} is gone since the run: the code quoted is as the run read it")


def as_recorded(evidence: Evidence, results: RuleResults) -> RuleResults:
    """`results` with each finding's quoted code as recorded where its file changed since the run or
    may not be read now (sources.stored_only), and a note for each changed file (add_load_note:
    shown by this render, never saved)."""
    changed = sources.changed(evidence)
    for file, (now, _) in sorted(changed.items()):
        add_load_note(evidence, changed_note(file, now))
    if not changed and not any(sources.stored_only(evidence, f) for f in evidence.sources):
        return results
    findings = []
    for f in results.findings:
        locs = [msgspec.structs.replace(loc, code=rec.strip()) if (rec := sources.quoted_line(evidence, loc.file, loc.line))
                is not None else loc for loc in f.locations]
        findings.append(msgspec.structs.replace(f, locations=locs))
    results.findings = findings
    return results


def differences(evidence: Evidence, results: RuleResults) -> list[str]:
    """Terminal lines: each changed file, and each finding's quoted line that reads otherwise now."""
    changed = sources.changed(evidence)
    out = []
    for file, (now, _) in sorted(changed.items()):
        out.append(f"note: {changed_note(file, now)}")
        lines = sorted({loc.line for f in results.findings for loc in f.locations if loc.file == file})
        for n in lines:
            rec = evidence.sources[file].lines.get(n)
            cur = sources.current_line(evidence, file, n)
            if rec is not None and cur != rec:
                out.append(f"  line {n}: at the run: {rec.strip()}")
                out.append(f"  {' ' * len(str(n))}       now: {cur.strip() if cur is not None else '(no such line)'}")
    return out
