"""A directory of traces with one that cannot be read: that one is skipped and named (on stderr,
and a note in the report), the others analysed. It aborted the whole directory. A directory whose
every trace is unreadable is still refused (exit 2)."""
from __future__ import annotations

import shutil
from pathlib import Path

from conftest import FIXTURES, audit

TRACE = FIXTURES / "traces" / "a100_item_sync_small.pt.trace.json.gz"
CLEAN = FIXTURES / "h100" / "plain" / "plain_gpu_clean.json.gz"  # (no host-sync in it)


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


def test_many_traces_are_summarised_per_rule(tmp_path: Path) -> None:
    """12 traces of one recording: the terminal gives each rule one line (how many findings, in how
    many recordings, the costliest), the page the costliest 5 of each and stays under 5 MB (it
    was 5.24 MB, and 72 MB for 2,000 traces), findings.json every finding."""
    d = tmp_path / "traces"
    d.mkdir()
    for i in range(12):
        shutil.copy(TRACE, d / f"t{i:02d}.pt.trace.json.gz")
    # a 13th recording where host-sync finds nothing: the line counts the recordings it fired in
    # (it said "in 13 recordings", the directory's count, whichever fired)
    shutil.copy(CLEAN, d / "clean.pt.trace.json.gz")
    a = audit("analyze", str(d), out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    # (a rule's line: its severity, then its id; the note of the traces recorded without stacks names it too)
    idle = [ln for ln in (a.out / "summary.txt").read_text().splitlines() if ln.split()[1:2] == ["gpu-idle"]]
    assert len(idle) == 1 and "gpu-idle 13 findings in all 13 recordings (each in findings.json); the costliest: " \
                              "The GPU waits" in idle[0], (a.out / "summary.txt").read_text()
    assert len(a.rule("gpu-idle")) == 13
    syncs = [ln for ln in (a.out / "summary.txt").read_text().splitlines() if ln.split()[1:2] == ["host-sync"]]
    assert len(syncs) == 1 and "host-sync 36 findings in 12 of 13 recordings (each in findings.json)" in syncs[0]
    assert len(a.rule("host-sync")) == 36
    page = (a.out / "report.html").read_text()
    assert (a.out / "report.html").stat().st_size < 5_000_000
    assert "This page shows the 5 costliest findings of each rule; " in page
    rules = {f["rule"] for f in a.findings_doc["findings"]}
    assert page.count('<article class="finding"') == sum(min(5, len(a.rule(r))) for r in rules)
