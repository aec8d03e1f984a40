"""`findings.sarif`: the findings as SARIF 2.1.0, for code-scanning UIs (GitHub, VS Code, IDEs).

The rule table comes from the same registry `audit rules` and `audit explain` read (id, title,
docstring as help, default severity), so SARIF cannot drift from the docs. Locations are made
relative to a base directory (the git toplevel of the code, else the current directory) under the
`%SRCROOT%` base id, which is what code-scanning uploads expect; a file outside the base keeps an
absolute `file://` URI. Code edits that go in fixes.patch are also given as SARIF `fixes`.
"""
from __future__ import annotations

import json
import math
import os
import re
import urllib.parse
from pathlib import Path
from typing import Any, Mapping

import msgspec

from auditor import __version__
from auditor.evidence.model import Evidence
from auditor.reports.base import Reporter, detail_of, first_sentence
from auditor.findings import Edit, Finding
from auditor.findings import RuleResults
from auditor.fixes import repo_root
from auditor.rules.registry import all_rules

SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
SRCROOT = "%SRCROOT%"
LEVELS = {"error": "error", "warning": "warning", "info": "note"}


def _first_paragraph(text: str) -> str:
    return text.strip().split("\n\n", 1)[0].replace("\n", " ").strip()


def rule_descriptor(cls: type) -> dict[str, Any]:
    """A SARIF reportingDescriptor from a rule class's own attributes and docstring."""
    docs = cls.docs()
    out: dict[str, Any] = {
        "id": cls.id,
        "name": "".join(w.capitalize() for w in cls.id.split("-")),
        "shortDescription": {"text": cls.title},
        "defaultConfiguration": {"level": LEVELS.get(cls.severity, "warning")},
        "properties": {"category": cls.category, "tags": [cls.category]},
    }
    if docs:
        out["fullDescription"] = {"text": _first_paragraph(docs)}
        out["help"] = {"text": docs, "markdown": docs}
    if cls.options:
        out["properties"]["options"] = {o.name: {"default": o.default, "help": o.help} for o in cls.options}
    return out


def _plain(value: Any) -> Any:
    """JSON-safe form of evidence values (tuples, Structs, odd scalars)."""
    return json.loads(json.dumps(msgspec.to_builtins(value), default=str))


class _Uris:
    """Turns file paths into SARIF artifactLocations relative to one base directory."""

    def __init__(self, base: Path) -> None:
        self.base = base.resolve()

    def location(self, file: str) -> dict[str, Any]:
        p = Path(file)
        p = p.resolve() if p.is_absolute() or p.exists() else (self.base / p).resolve()
        try:
            rel = p.relative_to(self.base)
        except ValueError:
            return {"uri": p.as_uri()}
        return {"uri": urllib.parse.quote(rel.as_posix()), "uriBaseId": SRCROOT}

    def original_uri_base_ids(self) -> dict[str, Any]:
        return {SRCROOT: {"uri": self.base.as_uri() + "/"}}


def _region(line: int, code: str = "") -> dict[str, Any]:
    region: dict[str, Any] = {"startLine": max(1, line)}
    if code:
        region["snippet"] = {"text": code}
    return region


def _replacement(e: Edit) -> dict[str, Any]:
    """Whole lines start..end replaced (an empty range at start for an insertion)."""
    text = "".join(ln + "\n" for ln in e.lines)
    if e.end < e.start:
        deleted = {"startLine": e.start, "startColumn": 1, "endLine": e.start, "endColumn": 1}
    else:
        deleted = {"startLine": e.start, "startColumn": 1, "endLine": e.end + 1, "endColumn": 1}
    return {"deletedRegion": deleted, "insertedContent": {"text": text}}


def _fixes(f: Finding, uris: _Uris) -> list[dict[str, Any]]:
    """The fix as SARIF `fixes`, which editors may apply at a click: one that keeps results and
    that --verify did not take out."""
    from auditor.reports.patch import verified_out

    if f.fix is None or not f.fix.edits or f.fix.changes_numerics or verified_out(f):
        return []
    by_file: dict[str, list[Edit]] = {}
    for e in f.fix.edits:
        by_file.setdefault(e.file, []).append(e)
    return [{"description": {"text": f.fix.summary},
             "artifactChanges": [{"artifactLocation": uris.location(file),
                                  "replacements": [_replacement(e) for e in edits]}
                                 for file, edits in by_file.items()]}]


def _message(f: Finding) -> dict[str, str]:
    """`text`: the message's first sentence, what a code-scanning list shows in a line; `markdown`:
    the whole message, its cost and its fix (the result's properties hold `detail`, the rest)."""
    text = _md(f.message)
    if f.cost and f.cost.ms_per_step is not None:
        kind = "measured" if f.cost.measured else "estimated"
        text += f" (cost: {f.cost.ms_per_step:.2f} ms/step, {kind})"
    if f.fix:
        text += f"\n\n**Fix:** {_md(f.fix.summary)}"
    return {"text": first_sentence(f.message), "markdown": text}


def _md(text: str) -> str:
    """`text` (it holds the user's names: ops, files) with Markdown's marks escaped, so that it
    shows as written and makes no link, image or HTML."""
    return re.sub(r"([\\`*_\[\]<>!|#~])", r"\\\1", text)


def input_file(f: Finding, evidence: Evidence) -> str | None:
    """The file a finding without a source line is about: its trace or snapshot, else the audited
    input (a checkpoint, the target's file). GitHub code scanning rejects a whole SARIF file when
    one of its results has no location."""
    named = [f.evidence.get(k) for k in ("trace", "snapshot", "file", "checkpoint")]
    held = f.evidence.get("files")  # the files of a checkpoint directory that hold what it is about
    named = [*(held if isinstance(held, list) else []), *named]
    target = (evidence.target or "").rsplit(":", 1)[0] if evidence.source == "run" else evidence.target
    run_file = [target] if evidence.source == "run" else []  # (a run's own finding: the trainer, not its trace)
    ck = evidence.checkpoint if evidence.source == "checkpoint" else None
    read = [p for ps in ((ck.files or {}) if ck is not None else {}).values() for p in ps]
    for c in [*named, *run_file, *evidence.snapshots, *evidence.traces, evidence.target, *read]:
        if isinstance(c, str) and c and os.path.isfile(c):
            return c
    return None


def result(f: Finding, rule_index: int, uris: _Uris, fallback: str | None = None) -> dict[str, Any]:
    """One SARIF result; extra locations beyond the first become relatedLocations. A finding with
    no source line is placed at line 1 of `fallback` (see input_file)."""
    out: dict[str, Any] = {
        "ruleId": f.rule,
        "ruleIndex": rule_index,
        "level": LEVELS.get(f.severity, "warning"),
        "message": _message(f),
        "properties": {"title": f.title, "detail": detail_of(f.message), "evidence": _plain(f.evidence)},
    }
    locs = [{"physicalLocation": {"artifactLocation": uris.location(loc.file), "region": _region(loc.line, loc.code)},
             **({"message": {"text": loc.note}} if loc.note else {})}
            for loc in f.locations]
    if not locs and fallback:
        locs = [{"physicalLocation": {"artifactLocation": uris.location(fallback), "region": _region(1)},
                 "message": {"text": "the audited file (no source line to point at)"}}]
    if locs:
        out["locations"] = locs[:1]
        if len(locs) > 1:
            out["relatedLocations"] = [{"id": i, **loc} for i, loc in enumerate(locs[1:], start=1)]
    if f.cost is not None:
        out["properties"]["cost"] = _plain(f.cost)
    if f.fix is not None and f.fix.config:
        out["properties"]["config"] = _plain(f.fix.config)
    fixes = _fixes(f, uris)
    if fixes:
        out["fixes"] = fixes
    return out


def _default_base(results: RuleResults) -> Path:
    for f in results.findings:
        for loc in f.locations:
            if os.path.exists(loc.file):
                return repo_root(loc.file)
    return Path.cwd()


def sarif_log(evidence: Evidence, results: RuleResults, base: Path | None = None,
              rules: Mapping[str, type] | None = None) -> dict[str, Any]:
    """The SARIF document as plain data. `rules` defaults to the registry."""
    registry = dict(all_rules() if rules is None else rules)
    descriptors = [rule_descriptor(cls) for cls in registry.values()]
    index = {d["id"]: i for i, d in enumerate(descriptors)}
    for f in results.findings:  # a finding from a rule the registry no longer lists still needs an entry
        if f.rule not in index:
            index[f.rule] = len(descriptors)
            descriptors.append({"id": f.rule, "shortDescription": {"text": f.title}})
    uris = _Uris(base or _default_base(results))
    notifications = [{"level": "error", "message": {"text": e["error"]},
                      "descriptor": {"id": e["rule"]}} for e in results.errors]
    notifications += [{"level": "note", "message": {"text": f"skipped: {s['reason']}"},
                       "descriptor": {"id": s["rule"]}} for s in results.skipped]
    invocation: dict[str, Any] = {
        "executionSuccessful": not results.errors,
        "toolExecutionNotifications": notifications,
        "properties": {"target": evidence.target, "ending": evidence.ending.status,
                       "suppressed": results.suppressed},
    }
    if evidence.ending.returncode is not None:
        invocation["exitCode"] = evidence.ending.returncode
    return {
        "$schema": SCHEMA,
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {"name": "auditor", "version": __version__, "semanticVersion": __version__,
                                "rules": descriptors}},
            "originalUriBaseIds": uris.original_uri_base_ids(),
            "invocations": [invocation],
            "results": [result(f, index[f.rule], uris, input_file(f, evidence)) for f in results.findings],
        }],
    }


class SarifReport(Reporter):
    name = "sarif"
    filename = "findings.sarif"

    def __init__(self, base: Path | None = None) -> None:
        self.base = base  # None: the git toplevel of the first located file, else the current directory

    def render(self, evidence: Evidence, results: RuleResults, out_dir: Path) -> bytes:
        # (JSON has no NaN or Infinity: a non-finite number is written null, as findings.json does)
        return json.dumps(finite(sarif_log(evidence, results, self.base)), indent=2, ensure_ascii=False,
                          allow_nan=False).encode("utf-8")


def finite(v: Any) -> Any:
    """`v` with each float that is NaN or infinite replaced by None (JSON's null)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [finite(x) for x in v]
    return v


__all__ = ["SarifReport", "sarif_log", "rule_descriptor", "result"]
