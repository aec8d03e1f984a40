"""Source provenance: the lines the reports quote, as the audit first read them.

A report quotes the user's code (each finding's place and the lines around it). Rendered again
later (`audit report DIR`, `audit analyze DIR`) after the file was edited, the line numbers would
point at other code. So the first render records each quoted file's sha256 and the lines it
quoted (`Evidence.sources`); a later render compares the file's hash with the recorded one and,
when they differ, quotes the recorded lines and says that the file changed since the run, showing
the file's current line beside each quoted line that differs.
"""
from __future__ import annotations

import hashlib
from typing import Any, Iterable

import msgspec

from auditor.evidence import source_access
from auditor.evidence.frame import Frame
from auditor.evidence.model import Evidence, SourceFile

MAX_BYTES = 4 << 20  # a file this large is no source a report quotes (a generated blob): not hashed
_CHANGED = "source_changes"  # Evidence.__dict__ key: {file: (sha256 now or None, lines now)}, per load


def _read(file: str) -> tuple[str, list[str]] | None:
    """The file's sha256 and its lines (without endings), None when it cannot be read (or is not
    under the source roots: auditor.evidence.source_access)."""
    try:
        with source_access.open_binary(file) as f:
            data = f.read(MAX_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_BYTES:
        return None
    return hashlib.sha256(data).hexdigest(), data.decode("utf-8", "replace").splitlines()


def frames(evidence: Evidence) -> set[tuple[str, int]]:
    """(file, line) of every recorded frame in the evidence (tallies, loaders, the ending ...)."""
    out: set[tuple[str, int]] = set()
    seen: set[int] = set()

    def walk(v: Any) -> None:
        if isinstance(v, Frame):
            if v.file and not v.file.startswith("<"):
                out.add((v.file, v.line))
        elif isinstance(v, msgspec.Struct):
            if id(v) in seen:
                return
            seen.add(id(v))
            for name in v.__struct_fields__:
                walk(getattr(v, name))
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)

    for name in ("setup", "outside", "steps", "graph_scans", "dataloaders", "ending"):
        walk(getattr(evidence, name))
    return out


def record(evidence: Evidence, places: Iterable[tuple[str, int]], context: int = 0) -> bool:
    """Record the lines around each (file, line) of `places` (`context` lines either side) in
    `evidence.sources`, for files not recorded yet or still as recorded (a changed file keeps its
    recorded lines: those it has now are another version). Whether anything was added."""
    added = False
    by_file: dict[str, set[int]] = {}
    for file, line in places:
        if file and line and line > 0:
            by_file.setdefault(file, set()).update(range(max(1, line - context), line + context + 1))
    for file, wanted in by_file.items():
        now = _read(file)
        if now is None:
            continue
        sha, lines = now
        known = evidence.sources.get(file)
        if known is not None and known.sha256 != sha:
            continue
        if known is None:
            known = evidence.sources[file] = SourceFile(sha256=sha)
            added = True
        for n in sorted(wanted):
            if n <= len(lines) and n not in known.lines:
                known.lines[n] = lines[n - 1]
                added = True
    return added


def changed(evidence: Evidence) -> dict[str, tuple[str | None, list[str]]]:
    """{file: (its sha256 now, None when gone; its lines now)} for each recorded file that is no
    longer as the audit read it (read once per loaded evidence)."""
    cached = evidence.__dict__.get(_CHANGED)
    if cached is None:
        cached = {}
        for file, src in evidence.sources.items():
            if not source_access.readable(file):  # (not ours to read now: quoted as recorded, see context)
                continue
            now = _read(file)
            if now is None:
                cached[file] = (None, [])
            elif now[0] != src.sha256:
                cached[file] = now
        evidence.__dict__[_CHANGED] = cached
    return cached


def stored_only(evidence: Evidence, file: str) -> bool:
    """Whether `file` is quoted from what the evidence stored alone: recorded, and not to be read
    now (outside the source roots: a run re-rendered from another directory, or a forged one)."""
    return file in evidence.sources and not source_access.readable(file)


def quoted_line(evidence: Evidence, file: str, line: int) -> str | None:
    """The recorded text of `file:line` when the file changed since it was recorded, or may not be
    read now (None: the file is as recorded, was never recorded, or that line was not quoted)."""
    if file not in changed(evidence) and not stored_only(evidence, file):
        return None
    return evidence.sources[file].lines.get(line)


def current_line(evidence: Evidence, file: str, line: int) -> str | None:
    """`file:line` as the changed file has it now (None: gone, or not that long)."""
    lines = changed(evidence).get(file, (None, []))[1]
    return lines[line - 1] if 0 < line <= len(lines) else None


def context(evidence: Evidence, file: str, line: int, around: int) -> list[dict[str, Any]] | None:
    """The recorded lines around `line` of a file that changed since the run, or that this render
    may not read (outside the source roots), each with the file's current text where it differs
    ({"n", "text", "hit", "now"}); None when the file is unchanged or not recorded (the caller
    reads it from disk)."""
    if file not in changed(evidence) and (file not in evidence.sources or source_access.readable(file)):
        return None
    rec = evidence.sources[file].lines
    out = []
    for n in range(max(1, line - around), line + around + 1):
        if n in rec:
            now = current_line(evidence, file, n)
            out.append({"n": n, "text": rec[n], "hit": n == line, "now": now if now != rec[n] else None})
    return out
