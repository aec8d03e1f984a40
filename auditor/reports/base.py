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


def first_sentence(message: str) -> str:
    """A finding's message up to the end of its first sentence: what the terminal, the report's
    table and SARIF's `message.text` show (the rest is the detail). A sentence ends at `.`, `!` or
    `?` outside brackets, followed by a space and a capital, a digit or an opening bracket."""
    depth = 0
    for i, c in enumerate(message):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth = max(0, depth - 1)
        elif c in ".!?" and depth == 0 and message[i + 1:i + 2] == " ":
            after = message[i + 2:i + 3]
            if after and (after.isupper() or after.isdigit() or after in "(["):
                return message[:i + 1]
    return message


def detail_of(message: str) -> str:
    """What a message says after its first sentence (first_sentence), or ''."""
    return message[len(first_sentence(message)):].strip()
