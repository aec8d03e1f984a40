"""What a reporter is: one small class per output format, rendering the same findings and evidence."""
from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from auditor.evidence.model import Evidence
from auditor.evidence.whole_files import write_whole
from auditor.findings import RuleResults


class Reporter:
    name: ClassVar[str]
    filename: ClassVar[str]  # written into the run directory

    def render(self, evidence: Evidence, results: RuleResults, out_dir: Path) -> str | bytes:
        raise NotImplementedError

    def write(self, evidence: Evidence, results: RuleResults, out_dir: Path) -> Path:
        return write_whole(out_dir / self.filename, self.render(evidence, results, out_dir))
