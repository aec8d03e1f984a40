"""What a reporter is: one small class per output format, rendering the same findings and evidence."""
from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from auditor.evidence.model import Evidence
from auditor.findings import RuleResults


class Reporter:
    name: ClassVar[str]
    filename: ClassVar[str]  # written into the run directory

    def render(self, evidence: Evidence, results: RuleResults, out_dir: Path) -> str | bytes:
        raise NotImplementedError

    def write(self, evidence: Evidence, results: RuleResults, out_dir: Path) -> Path:
        data = self.render(evidence, results, out_dir)
        path = out_dir / self.filename
        if isinstance(data, str):
            path.write_text(data, encoding="utf-8")
        else:
            path.write_bytes(data)
        return path
