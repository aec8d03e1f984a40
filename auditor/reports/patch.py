"""`fixes.patch`: every finding's code edits joined into one unified diff that `git apply` accepts.

A fix's edits replace whole source lines captured during the run (`Edit(file, start, end, lines)`;
`end == start - 1` inserts before `start`). Edits are grouped per file and applied bottom-up so
earlier line numbers stay valid; an edit that overlaps one already taken is left out and listed in
the patch's preamble, as are fixes marked `changes_numerics` (they may change results, so the user
applies them by hand). Paths are relative to the file's git toplevel, or to the current directory
outside a repository, with `a/` and `b/` prefixes: run `git apply fixes.patch` at that root.

The diff core (`make_patch`, `diff_edits`, ...) lives in `auditor/rules/fixes.py`, where the rule
engine also uses it to fill each finding's `Fix.patch`; it is re-exported here.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from auditor.evidence.model import Evidence
from auditor.reports.base import Reporter
from auditor.rules.base import Edit, Finding
from auditor.rules.engine import RuleResults
from auditor.rules.fixes import (PatchResult, apply_edits, diff_edits, make_patch, patch_path, plan_edits,
                                 repo_root, unified_diff)

__all__ = ["PatchReport", "patchable", "PatchResult", "apply_edits", "diff_edits", "make_patch", "patch_path",
           "plan_edits", "repo_root", "unified_diff"]


def patchable(findings: Iterable[Finding]) -> list[Finding]:
    """Findings whose code edits belong in fixes.patch (those changing numerics stay out)."""
    return [f for f in findings if f.fix is not None and f.fix.edits and not f.fix.changes_numerics]


def _preamble(findings: list[Finding], left_out: list[Finding], skipped: list[tuple[Edit, str]]) -> str:
    """Comment lines before the first `diff --git`; git apply and patch ignore them."""
    lines = ["auditor fixes.patch: code edits proposed by the audit.",
             "Apply at the repository root (or where the audit ran): git apply fixes.patch",
             "Fixes from: " + ", ".join(sorted({f.rule for f in findings}))]
    for f in left_out:
        lines.append(f"Left out ({f.rule}): may change numerics, apply by hand: {f.fix.summary if f.fix else ''}")
    for e, why in skipped:
        lines.append(f"Left out: {e.file}:{e.start}-{e.end}: {why}")
    return "".join("# " + ln.replace("\n", " ") + "\n" for ln in lines) + "\n"


class PatchReport(Reporter):
    """fixes.patch; empty when no finding has an edit that can go in it."""

    name = "patch"
    filename = "fixes.patch"

    def __init__(self, root: Path | None = None) -> None:
        self.root = root  # None: each file's git toplevel, else the current directory

    def render(self, evidence: Evidence, results: RuleResults, out_dir: Path) -> str:
        findings = patchable(results.findings)
        left_out = [f for f in results.findings if f.fix is not None and f.fix.edits and f.fix.changes_numerics]
        result = diff_edits([e for f in findings for e in f.fix.edits], self.root)  # type: ignore[union-attr]
        if not result.diff:
            return ""
        return _preamble(findings, left_out, result.skipped) + result.diff
