"""Small inputs refused with the words for what they are: an evidence.json of a later version (it
rendered an empty report over the run's), --out naming a device ("cannot write there (File exists)"),
a symlink loop or a dangling symlink ("no such file or directory"), a snapshot dict without
segments ("expected a dict with 'segments', got dict")."""
from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from auditor import cli
from conftest import FIXTURES

TRACE = FIXTURES / "traces" / "a100_item_sync_small.pt.trace.json.gz"


def error_of(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("audit: error: "), err
    return err.strip()


def test_a_later_evidence_version_is_refused_and_nothing_overwritten(tmp_path: Path, capsys) -> None:
    (tmp_path / "evidence.json").write_text('{"version": 999}')
    (tmp_path / "report.html").write_text("the run's report")
    err = error_of(["report", str(tmp_path)], capsys)
    assert err.endswith("evidence.json: evidence version 999, which this auditor (version 2) does not read; "
                        "an auditor of that version renders it")
    assert (tmp_path / "report.html").read_text() == "the run's report"
    assert not (tmp_path / "findings.json").exists()


def test_out_naming_a_device(capsys) -> None:
    """(a regular file click refuses itself: "is a file")"""
    assert error_of(["analyze", str(TRACE), "--out", "/dev/null"], capsys) == "audit: error: --out /dev/null: not a directory"


def test_symlinks_that_lead_nowhere(tmp_path: Path, capsys) -> None:
    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    assert error_of(["analyze", str(tmp_path / "a")], capsys) == f"audit: error: {tmp_path / 'a'}: a symlink loop"
    assert error_of(["analyze", str(tmp_path / "dangling")], capsys) == \
        f"audit: error: {tmp_path / 'dangling'}: a symlink to {tmp_path / 'gone'}, which does not exist"


def test_a_snapshot_dict_without_segments(tmp_path: Path, capsys) -> None:
    p = tmp_path / "s.pickle"
    p.write_bytes(pickle.dumps({"device_traces": []}, protocol=4))
    assert error_of(["analyze", str(p)], capsys).endswith(
        "not a CUDA memory snapshot (expected a dict with a 'segments' list, got a dict without a 'segments' list)")


@pytest.mark.parametrize("value", ["inf", "nan", "-inf", "0"])
def test_a_trace_size_that_is_no_size(value: str, capsys) -> None:
    """inf reached the child, which failed with an OverflowError blamed on the program (exit 3);
    nan was taken silently."""
    assert error_of(["run", "examples/clean.py:step", "--trace-size", value], capsys) == (
        f"audit: error: Invalid value for '--trace-size': {value} is out of range: a number of MB, from 0.001 "
        "to 1073741824 (1 PiB)")


def _old_schema_trace(call_stack: bytes) -> bytes:
    """Two operators of the old schema (whose `Call stack` argument is read), the first's stack given raw."""
    import json

    events = [{"ph": "X", "cat": "Operator", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 1000, "dur": 50,
               "args": {"Call stack": "STACK"}},
              {"ph": "X", "cat": "Operator", "name": "aten::add", "pid": 1, "tid": 1, "ts": 1100, "dur": 50}]
    return json.dumps({"traceEvents": events}).encode().replace(b"STACK", call_stack)


def test_invalid_utf8_in_a_call_stack(tmp_path: Path, capsys) -> None:
    p = tmp_path / "t.json"
    p.write_bytes(_old_schema_trace(b"train.py(3): f\xff\xfe"))
    assert error_of(["analyze", str(p), "--out", str(tmp_path / "out")], capsys) == (
        f"audit: error: {p}: not a readable profiler trace (Invalid UTF-8 encoded string)")


def test_a_header_nested_past_the_decoders_depth(tmp_path: Path, capsys) -> None:
    depth = 100_000
    p = tmp_path / "t.json"
    p.write_bytes(b'{"schemaVersion": 1, "k": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b', "traceEvents": '
                  + _old_schema_trace(b"f")[len(b'{"traceEvents": '):])
    assert error_of(["analyze", str(p), "--out", str(tmp_path / "out")], capsys) == (
        f"audit: error: {p}: not a readable profiler trace (nests objects or arrays too deeply)")


def test_a_directory_holding_a_link_it_may_not_read(tmp_path: Path, capsys) -> None:
    """A link to another process's /proc/PID/cwd: not searched (nor is any linked directory)."""
    d = tmp_path / "logdir"
    d.mkdir()
    os.symlink("/proc/1/cwd", d / "link")
    assert error_of(["analyze", str(d), "--out", str(tmp_path / "out")], capsys) == (
        f"audit: error: {d}: not an audit run directory and holds no *.pt.trace.json[.gz] profiler traces")
