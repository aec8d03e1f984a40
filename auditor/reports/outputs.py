"""Every output of an audit: its reporters, in the order they are written, and writing them all."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from auditor.evidence.model import Evidence
from auditor.reports.base import Reporter
from auditor.reports.findings_json import FindingsJson
from auditor.reports.html import HtmlReport
from auditor.reports.patch import PatchReport
from auditor.reports.sarif import SarifReport
from auditor.reports.terminal import TerminalSummary
from auditor.findings import RuleResults


def all_reporters() -> list[Reporter]:
    return [FindingsJson(), HtmlReport(), SarifReport(), PatchReport(), TerminalSummary()]


def write_reports(out_dir: Path, evidence: Evidence, results: RuleResults) -> dict[str, Path]:
    """Write every format, each file whole or not at all (auditor.evidence.whole_files); one failing
    reporter must not cost the user the others: those not written are left out of the result."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for r in all_reporters():
        try:
            written[r.name] = r.write(evidence, results, out_dir)
        except Exception as e:
            if os.environ.get("AUDIT_DEBUG"):
                raise
            why = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
            print(f"audit: warning: could not write {r.filename}: {why}", file=sys.stderr)
    return written
