"""Kineto writes its trace's own path into the trace's JSON unescaped: under an --out holding a
quote or a backslash the trace was unreadable, and the rules that read it were skipped with no word.
The profiler writes such a run's trace under a name of the audit's choosing, then it is moved into
the run directory: the trace reads, and its rules run."""
from __future__ import annotations

import tempfile
from pathlib import Path

from auditor.capture.child import _trace_dir, _unsafe_for_trace
from auditor.evidence.trace.load import load_trace
from quoted_out_run import quoted_out_run


def test_unsafe_paths_get_a_directory_of_the_audits_choosing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # (the chosen ones land there)
    (tmp_path / "tmp").mkdir()
    for bad in ('a"b', "a\\b", "a\x7fb"):
        logdir = str(tmp_path / bad / "tb" / "run")
        chosen = _trace_dir(logdir)
        assert chosen != logdir and not _unsafe_for_trace(chosen)
        assert Path(chosen) == tmp_path / "tmp"  # (the export's private scratch directory goes there)
    assert _trace_dir(str(tmp_path / "plain" / "tb" / "run")) == str(tmp_path / "plain" / "tb" / "run")


def test_a_quote_and_a_backslash_in_out_keep_the_trace_readable(tmp_path_factory) -> None:
    a = quoted_out_run(tmp_path_factory)  # (its --out also held an earlier audit's trace: test_reused_out)
    out = a.out
    assert '"' in out.name and "\\" in out.name
    assert a.returncode == 0, a.stderr
    [trace] = (out / "tb").glob("*/*.pt.trace.json.gz")
    assert len(load_trace(trace).events)
    notes = a.evidence["environment"]["notes"]
    assert not any("profiler trace" in n for n in notes), notes
    # (the rules that read the trace ran: none is skipped for want of one)
    assert not [s for s in a.findings_doc["skipped_rules"] if "trace" in s["reason"] and "per-rank" not in s["reason"]]
    assert not list(out.parent.glob("audit-trace-*"))


def test_a_quote_in_the_scripts_name_keeps_the_trace_readable(tmp_path) -> None:
    """Kineto writes a Python frame's name (`my"train.py(9): step`) unescaped: the kept trace was
    invalid JSON, and only the report said so. The audit escapes such a name as it keeps the trace."""
    import gzip
    import json
    import shutil

    from conftest import EXAMPLES, audit

    script = tmp_path / 'my"train.py'
    shutil.copy(EXAMPLES / "clean.py", script)
    shutil.copy(EXAMPLES / "_common.py", tmp_path)
    a = audit("run", f"{script}:step", "--steps", "6", "--no-numerics", "-q", out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    [trace] = (tmp_path / "out" / "tb").glob("*/*.pt.trace.json.gz")
    doc = json.loads(gzip.decompress(trace.read_bytes()))  # (valid JSON: TensorBoard reads it too)
    assert 'my"train.py(9): step' in {e.get("name") for e in doc["traceEvents"]}  # (torch names it by its base)
    assert not any("profiler trace" in n for n in a.evidence["environment"]["notes"])
