"""`fixes.patch`: every finding's code edits joined into one unified diff that `git apply` accepts.

A fix's edits replace whole source lines captured during the run (`Edit(file, start, end, lines)`;
`end == start - 1` inserts before `start`). Edits are grouped per file and applied bottom-up so
earlier line numbers stay valid; of two overlapping edits the first is taken (a fix another works
only after first, then one that changes results, which on a shared line carries both settings), and
the other is listed in the patch's preamble. The preamble lists every fix the patch holds, marking
those that change what the training computes (a clamp, clipping, a new data order) for review.
Paths are relative to the file's git toplevel, or to the current directory outside a repository,
with `a/` and `b/` prefixes: run `git apply fixes.patch` at that root.

The diff core (`diff_edits`, `make_patch`, ...) lives in `auditor/fixes.py`, which the rule engine
also uses to fill each finding's `Fix.patch`.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterable

from auditor.evidence.model import Evidence
from auditor.evidence.whole_files import write_whole
from auditor.reports.base import Reporter
from auditor.findings import Edit, Finding
from auditor.findings import RuleResults
from auditor.fixes import diff_edits

__all__ = ["PatchReport", "patchable", "patch_order", "prerequisites", "same_results"]


def verified_out(f: Finding) -> bool:
    """Whether `audit run --verify` took the fix out of fixes.patch: re-run with it, the program
    failed, its finding stayed, or its weights changed where it should keep them."""
    return f.fix is not None and f.fix.verified is not None and f.fix.verified.status != "improved"


def patchable(findings: Iterable[Finding]) -> list[Finding]:
    """Findings whose code edits belong in fixes.patch (all but those verification took out)."""
    return [f for f in findings if f.fix is not None and f.fix.edits and not verified_out(f)]


def same_results(findings: Iterable[Finding]) -> list[Finding]:
    """Of `patchable`, the fixes that leave what the training computes unchanged: `--verify` re-runs
    them together and proves the weights the same."""
    return [f for f in patchable(findings) if not f.fix.changes_numerics]  # type: ignore[union-attr]


def prerequisites(f: Finding, findings: list[Finding]) -> list[Finding]:
    """The findings whose fixes `f`'s works only after (evidence `apply_after`, auditor.rules.
    attribution.ORDER), with edits to apply first."""
    names = f.evidence.get("apply_after") if isinstance(f.evidence, dict) else None
    return [g for g in findings if names and g.rule in names and g.fix is not None and g.fix.edits]


def patch_order(fixed: Iterable[Finding], findings: list[Finding]) -> list[Finding]:
    """The order edits are taken in, the first of two overlapping edits winning: a fix that others
    work only after first; then one that changes results (on a DataLoader line its edit carries the
    other's setting too)."""
    return sorted(fixed, key=lambda f: (len(prerequisites(f, findings)), not f.fix.changes_numerics))  # type: ignore[union-attr]


def _preamble(head: list[str], findings: list[Finding], skipped: list[tuple[Edit, str]]) -> str:
    """Comment lines before the first `diff --git`; git apply and patch ignore them: `head`, a line
    for each fix of `findings` the patch holds an edit of (at the first such edit), and the edits
    left out and why."""
    lines = list(head)
    left = {id(e) for e, _ in skipped}
    for f in findings:
        first = next((e for e in f.fix.edits if id(e) not in left), None)  # type: ignore[union-attr]
        if first is None:
            continue
        mark = " [changes results: review it]" if f.fix.changes_numerics else ""  # type: ignore[union-attr]
        lines.append(f"  {f.rule} {Path(first.file).name}:{first.start}{mark}")
    owner = {id(e): f.rule for f in findings for e in (f.fix.edits if f.fix is not None else [])}
    for e, why in skipped:
        of = f" ({owner[id(e)]})" if id(e) in owner else ""
        lines.append(f"Left out{of}: {Path(e.file).name}:{e.start}-{e.end}: {why}")
    return "".join("# " + ln.replace("\n", " ") + "\n" for ln in lines) + "\n"


def _where_to_apply(edits: list, root: Path | None, path: Path) -> str:
    """The preamble's line on where the patch applies: at the repository root (or the directory the
    audit ran in); where it edits a file outside that (a target given as ../train.py outside a
    repository), the patch names it by its absolute path, and only `git apply` run from `/` finds it."""
    from auditor.fixes import outside_root

    outside = sorted({str(Path(e.file).resolve()) for e in edits if outside_root(e.file, root)})
    if outside:
        return (f"Apply from the filesystem's root: cd / && git apply {path.resolve()} ({outside[0]} is outside "
                "the repository and the directory the audit ran in, so the patch names it by its absolute path)")
    return "Apply at the repository root (or where the audit ran): git apply fixes.patch"


OLDER_NUMERICS_PATCH = "numerics-fixes.patch"  # (older versions wrote result-changing edits there)


def _drop_older_numerics_patch(out_dir: Path) -> None:
    """An older audit's numerics-fixes.patch, whose edits fixes.patch now holds, is removed: a plain
    file that audit wrote (its first line says so), never a link or a user's own file of that name."""
    old = out_dir / OLDER_NUMERICS_PATCH
    with contextlib.suppress(OSError):
        if old.is_symlink() or not old.is_file():
            return
        with old.open("rb") as fh:
            made_by_an_audit = fh.read(64).startswith(b"# auditor numerics-fixes.patch")
        if made_by_an_audit:
            old.unlink()


class PatchReport(Reporter):
    """fixes.patch; not written when no finding has an edit that can go in it."""

    name = "patch"
    filename = "fixes.patch"

    def __init__(self, root: Path | None = None) -> None:
        self.root = root  # None: each file's git toplevel, else the current directory

    def write(self, evidence: Evidence, results: RuleResults, out_dir: Path) -> Path:
        """The patch file, written only when it holds a patch: an empty one makes `git apply` fail
        ("No valid patches in input"). One left in the run directory by an earlier audit is removed."""
        text = self.render(evidence, results, out_dir)
        path = out_dir / self.filename
        if text:
            write_whole(path, text)
        else:
            path.unlink(missing_ok=True)
        _drop_older_numerics_patch(out_dir)
        return path

    def render(self, evidence: Evidence, results: RuleResults, out_dir: Path) -> str:
        findings = patch_order(patchable(results.findings), results.findings)
        edits = [e for f in findings for e in f.fix.edits]  # type: ignore[union-attr]
        result = diff_edits(edits, self.root)
        if not result.diff:
            return ""
        head = ["auditor fixes.patch: every code edit the audit proposes; the fixes it holds, one a line:",
                _where_to_apply(edits, self.root, out_dir / self.filename),
                *(f"Left out ({f.rule}): verification: {f.fix.verified.status}: {f.fix.verified.note}"  # type: ignore[union-attr]
                  for f in results.findings if verified_out(f) and f.fix is not None and f.fix.edits)]
        return _preamble(head, findings, result.skipped) + result.diff
