"""`# audit: ignore[rule-id]` comments: which findings, sites and edits they silence.

The semantics follow what linter users know from ruff's and pylint's noqa:

* A comment counts for the whole statement it is written on: on any line of a multi-line call
  (a formatter puts it on the closing line) it covers every line of that call. For a compound
  statement (`with`, `if`, `def`) only its header counts, not its body.
* A comment on a finding's primary location (its first, the one the terminal names) silences the
  finding. A comment on another of its locations only takes that location out.
* Rules that add several sites into one finding (host-sync's syncs, forced-cleanup's calls) leave
  suppressed sites out of their counts, message and evidence themselves, through `unsuppressed`:
  the engine cannot re-derive a rule's tallies, and a rule cannot count what it never saw.
* No edit of a fix touches a suppressed statement, nor removes an `audit: ignore` comment.
"""
from __future__ import annotations

import ast
import re
from functools import lru_cache
from typing import Callable, Iterable, TypeVar

from auditor.findings import Edit
from auditor.evidence import source_access

SUPPRESS = re.compile(r"#\s*audit:\s*ignore(?:\[([a-z0-9,\s-]+)\])?")

T = TypeVar("T")


def _covers(comment_line: str, rule_id: str) -> bool:
    m = SUPPRESS.search(comment_line)
    return bool(m) and (m.group(1) is None or rule_id in {r.strip() for r in m.group(1).split(",")})


@lru_cache(maxsize=256)
def _spans(file: str) -> tuple[tuple[int, int], ...]:
    """The (first, last) lines each statement of `file` owns: a simple statement all its lines, a
    compound one its header (up to its body). Only files holding a suppression comment are parsed:
    most locations are in files (torch's, say) that hold none."""
    lines = source_access.getlines(file)
    if not any("audit" in ln and SUPPRESS.search(ln) for ln in lines):
        return ()
    try:
        tree = ast.parse("".join(lines))
    except (SyntaxError, ValueError):
        return ()
    spans = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt):
            continue
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
            spans.append((node.lineno, max(node.lineno, body[0].lineno - 1)))
        else:
            spans.append((node.lineno, node.end_lineno or node.lineno))
    return tuple(spans)


def statement_span(file: str, line: int) -> tuple[int, int]:
    """The lines of the statement (or compound statement's header) holding `line`; the line alone
    when the file cannot be parsed or holds no suppression comment."""
    owning = [s for s in _spans(file) if s[0] <= line <= s[1]]
    return min(owning, key=lambda s: s[1] - s[0]) if owning else (line, line)


def suppressed_at(file: str, line: int, rule_id: str) -> bool:
    """True when the statement holding `file:line` carries `# audit: ignore` or
    `# audit: ignore[rule-id, ...]` on any of its lines."""
    first, last = statement_span(file, line)
    return any(_covers(source_access.getline(file, n), rule_id) for n in range(first, last + 1))


def unsuppressed(rule_id: str, sites: list[T], where: Callable[[T], object]) -> list[T]:
    """The sites (places, copies) a rule adds into one finding, less those whose `where` (a Frame
    or None) is suppressed for `rule_id`. When every site is suppressed, all are returned: the
    finding is then made as before, its primary location is suppressed, and the engine drops it
    whole and counts it as suppressed (a rule that yielded nothing would not be counted)."""
    kept = [s for s in sites if not ((w := where(s)) is not None and suppressed_at(w.file, w.line, rule_id))]
    return kept or sites


def safe_edits(edits: Iterable[Edit], rule_id: str) -> list[Edit]:
    """The edits that neither touch a statement suppressed for `rule_id` nor drop an
    `audit: ignore` comment (for any rule) from the lines they replace: applying the patch must not
    undo what the user silenced."""
    out = []
    for e in edits:
        old = [source_access.getline(e.file, n) for n in range(e.start, e.end + 1)]
        touched = list(range(e.start, e.end + 1))
        if not touched and e.start > 1 and statement_span(e.file, e.start - 1) == statement_span(e.file, e.start):
            touched = [e.start]  # lines inserted inside one statement (an argument added to a call) edit it
        if any(suppressed_at(e.file, n, rule_id) for n in touched):
            continue
        new = "\n".join(e.lines)
        if any((m := SUPPRESS.search(ln)) and m.group(0) not in new for ln in old):
            continue
        out.append(e)
    return out
