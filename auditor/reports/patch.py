"""`fixes.patch`: every finding's code edits joined into one unified diff that `git apply` accepts.

A fix's edits replace whole source lines captured during the run (`Edit(file, start, end, lines)`;
`end == start - 1` inserts before `start`). Edits are grouped per file and applied bottom-up so
earlier line numbers stay valid; an edit that overlaps one already taken is left out and listed in
the patch's preamble. Fixes marked `changes_numerics` (a clamp, gradient clipping, a warmup: they
change what the training computes) go in `numerics-fixes.patch` instead, so that applying
fixes.patch never changes results and the user reviews those one by one. Paths are relative to
the file's git toplevel, or to the current directory outside a repository, with `a/` and `b/`
prefixes: run `git apply fixes.patch` at that root.

The diff core (`diff_edits`, `make_patch`, ...) lives in `auditor/fixes.py`, which the rule engine
also uses to fill each finding's `Fix.patch`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from auditor.evidence.model import Evidence
from auditor.evidence.whole_files import write_whole
from auditor.reports.base import Reporter
from auditor.findings import Edit, Finding
from auditor.findings import RuleResults
from auditor.fixes import _conflict, diff_edits, outside_root

__all__ = ["NumericsPatchReport", "PatchReport", "patchable", "numerics_patchable"]


def verified_out(f: Finding) -> bool:
    """Whether `audit run --verify` took the fix out of the patch files: re-run with it, the
    program failed, its finding stayed, or (fixes.patch) its weights changed."""
    return f.fix is not None and f.fix.verified is not None and f.fix.verified.status != "improved"


def patchable(findings: Iterable[Finding]) -> list[Finding]:
    """Findings whose code edits belong in fixes.patch (those changing numerics stay out, and
    those verification took out)."""
    return [f for f in findings if f.fix is not None and f.fix.edits and not f.fix.changes_numerics
            and not verified_out(f)]


def numerics_patchable(findings: Iterable[Finding]) -> list[Finding]:
    """Findings whose code edits change what the training computes: numerics-fixes.patch (but
    those verification took out)."""
    return [f for f in findings if f.fix is not None and f.fix.edits and f.fix.changes_numerics
            and not verified_out(f)]


def _verified_out_lines(findings: Iterable[Finding], numerics: bool) -> list[str]:
    return [f"Left out ({f.rule}): verification: {f.fix.verified.status}: {f.fix.verified.note}"  # type: ignore[union-attr]
            for f in findings if verified_out(f) and f.fix is not None and f.fix.edits
            and f.fix.changes_numerics == numerics]


CONTEXT = 3  # the lines of context each hunk of a patch carries (fixes.unified_diff's default)


def fixes_patch_edits(findings: Iterable[Finding]) -> tuple[list[Edit], list[Edit]]:
    """(the edits fixes.patch holds, those it leaves to numerics-fixes.patch). numerics-fixes.patch
    applies "after or instead of" fixes.patch: lines both would edit (a DataLoader call given
    pin_memory here and workers there), or that a numerics hunk's context holds (a label made on
    the device two lines above noise drawn there), stay out of fixes.patch; numerics-fixes.patch
    carries the second kind itself (`NumericsPatchReport`), the first its own edit of those lines."""
    findings = list(findings)
    theirs = [e for f in numerics_patchable(findings) for e in f.fix.edits]  # type: ignore[union-attr]
    edits = [e for f in patchable(findings) for e in f.fix.edits]  # type: ignore[union-attr]
    shared = [e for e in edits if any(_same_file(e, t) and _conflict(e, t) for t in theirs)]
    edits = [e for e in edits if e not in shared]
    taken: list[Edit] = []  # (what fixes.patch takes: the first of two overlapping edits, as diff_edits)
    for e in edits:
        if not any(_same_file(e, t) and _conflict(e, t) for t in taken):
            taken.append(e)
    moved = True
    while moved:  # (an edit numerics-fixes.patch takes on has a context of its own)
        near = [e for e in taken if any(_same_file(e, t) and _near(e, t) for t in [*theirs, *shared])]
        moved = bool(near)
        shared += near
        taken = [e for e in taken if e not in near]
    return [e for e in edits if e not in shared], shared


def _near(a: Edit, b: Edit) -> bool:
    """Whether the edits touch the same lines, or one lies in the other's hunk context."""
    return _conflict(a, b) or (a.start - CONTEXT <= b.end and b.start - CONTEXT <= a.end)


def _preamble(head: list[str], findings: list[Finding], left_out: list[Finding],
              skipped: list[tuple[Edit, str]]) -> str:
    """Comment lines before the first `diff --git`; git apply and patch ignore them."""
    lines = [*head, "Fixes from: " + ", ".join(sorted({f.rule for f in findings}))]
    for f in left_out:
        lines.append(f"Left out ({f.rule}): changes numerics, see numerics-fixes.patch: {f.fix.summary if f.fix else ''}")
    for e, why in skipped:
        lines.append(f"Left out: {e.file}:{e.start}-{e.end}: {why}")
    return "".join("# " + ln.replace("\n", " ") + "\n" for ln in lines) + "\n"


def _same_file(a: Edit, b: Edit) -> bool:
    return Path(a.file).resolve() == Path(b.file).resolve()


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
        return path

    def render(self, evidence: Evidence, results: RuleResults, out_dir: Path) -> str:
        findings = patchable(results.findings)
        left_out = numerics_patchable(results.findings)
        edits, shared = fixes_patch_edits(results.findings)
        result = diff_edits(edits, self.root)
        result.skipped.extend((e, "numerics-fixes.patch edits these lines or the lines beside them (so that it "
                                  "applies after or instead of this patch); the finding's own patch in findings.json "
                                  "has this edit") for e in shared)
        if not result.diff:
            return ""
        head = ["auditor fixes.patch: code edits proposed by the audit; none changes what the training computes.",
                _where_to_apply(edits, self.root, out_dir / self.filename, "git apply fixes.patch", "at the repository root (or where the audit ran)"),
                *_verified_out_lines(results.findings, numerics=False)]
        return _preamble(head, findings, left_out, result.skipped) + result.diff


def _where_to_apply(edits: list, root: Path | None, path: Path, command: str, where: str,
                    parenthesised: bool = False) -> str:
    """The preamble's line on where the patch applies: at the repository root (or the directory the
    audit ran in); where it edits a file outside that (a target given as ../train.py outside a
    repository), the patch names it by its absolute path, and only `git apply` run from `/` finds it."""
    outside = sorted({str(Path(e.file).resolve()) for e in edits if outside_root(e.file, root)})
    if outside:
        return (f"Apply from the filesystem's root: cd / && git apply {path.resolve()} ({outside[0]} is outside "
                "the repository and the directory the audit ran in, so the patch names it by its absolute path)")
    return f"{command} ({where})" if parenthesised else f"Apply {where}: {command}"


class NumericsPatchReport(PatchReport):
    """numerics-fixes.patch: the edits that change results (clamps, clipping, warmup), kept apart
    from fixes.patch so each is reviewed before it is applied; not written when there are none."""

    name = "numerics-patch"
    filename = "numerics-fixes.patch"

    def render(self, evidence: Evidence, results: RuleResults, out_dir: Path) -> str:
        findings = numerics_patchable(results.findings)
        # with the edits fixes.patch leaves out beside these (they change no result; those of the
        # same lines are the numerics edit's own)
        own = [e for f in findings for e in f.fix.edits]  # type: ignore[union-attr]
        beside = [e for e in fixes_patch_edits(results.findings)[1]
                  if not any(_same_file(e, t) and _conflict(e, t) for t in own)]
        result = diff_edits([*own, *beside], self.root)
        if not result.diff:
            return ""
        head = ["auditor numerics-fixes.patch: code edits that change what the training computes",
                "(clamps, gradient clipping, learning-rate warmup, fused optimizers; DataLoader workers, whose random",
                "augmentations draw from each worker's own seed). Review each one before applying:",
                _where_to_apply(own, self.root,
                                out_dir / self.filename, "git apply numerics-fixes.patch",
                                "at the repository root, after or instead of fixes.patch", parenthesised=True),
                *_verified_out_lines(results.findings, numerics=True)]
        if beside:
            rules = sorted({f.rule for f in patchable(results.findings) if any(e in beside for e in f.fix.edits)})  # type: ignore[union-attr]
            head.append(f"With {len(beside)} edit(s) of {', '.join(rules)} that change no result, left out of fixes.patch "
                        "for lying beside these edits (so that this patch applies after or instead of it)")
        return _preamble(head, findings, [], result.skipped) + result.diff
