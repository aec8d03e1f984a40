"""A directory of traces with one that cannot be read: that one is skipped and named (on stderr,
and a note in the report), the others analysed. It aborted the whole directory. A directory whose
every trace is unreadable is still refused (exit 2)."""
from __future__ import annotations

import shutil
from pathlib import Path

from conftest import FIXTURES, audit

TRACE = FIXTURES / "traces" / "a100_item_sync_small.pt.trace.json.gz"


def test_an_unreadable_trace_is_skipped_and_named(tmp_path: Path) -> None:
    d = tmp_path / "traces"
    d.mkdir()
    shutil.copy(TRACE, d / "a.pt.trace.json.gz")
    shutil.copy(TRACE, d / "b.pt.trace.json.gz")
    (d / "c.pt.trace.json").write_text('{"traceEvents": [1')
    a = audit("analyze", str(d), out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    assert "audit: 1 trace(s) not read, the others analysed:" in a.stderr
    assert f"{d / 'c.pt.trace.json'}: not a profiler trace: traceEvents holds a non-object" in a.stderr
    assert any("c.pt.trace.json" in n and "not read" in n for n in a.findings_doc["environment"]["notes"])
    assert a.rule("host-sync")  # the readable traces were analysed


def test_a_directory_of_nothing_readable_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "traces"
    d.mkdir()
    (d / "c.pt.trace.json").write_text('{"traceEvents": [1')
    a = audit("analyze", str(d), out=tmp_path / "out")
    assert a.returncode == 2
    assert a.stderr.strip().endswith("c.pt.trace.json: not a profiler trace: traceEvents holds a non-object")
