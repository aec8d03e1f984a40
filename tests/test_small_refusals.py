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
