"""A memory snapshot's sizes that cannot be (2**70 bytes, negative, a string, NaN) are left out
where the snapshot is read, counted in one summary line: they ended the audit with an internal
OverflowError (allocator/replay.py) or printed "-5 B reserved" and "1125899906842624.0 GiB"."""
from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest

from auditor.evidence.snapshot import load_snapshot
from conftest import FIXTURES, audit

SNAPSHOT = FIXTURES / "snapshots" / "transformer_fullstep_with_history.pickle"


def spoilt(tmp_path: Path, value) -> Path:
    """The fixture with one trace entry's size set to `value` and a segment's total to it."""
    raw = pickle.loads(SNAPSHOT.read_bytes())
    bad = copy.deepcopy(raw)
    entry = next(e for t in bad["device_traces"] for e in t if e.get("action") == "segment_alloc")
    entry["size"] = value
    bad["segments"][0]["total_size"] = value
    p = tmp_path / "spoilt.pickle"
    p.write_bytes(pickle.dumps(bad, protocol=4))
    return p


@pytest.mark.parametrize("value", [2 ** 70, -5, "512", float("nan")], ids=["2**70", "negative", "string", "nan"])
def test_impossible_sizes_are_left_out_and_counted(tmp_path: Path, value) -> None:
    snap = load_snapshot(spoilt(tmp_path, value))
    good = load_snapshot(SNAPSHOT)
    assert snap.dropped.startswith("2 entries with sizes no device has were left out (the first: a segment: total_size ")
    assert len(snap.segments) == len(good.segments) - 1
    assert sum(map(len, snap.device_traces)) == sum(map(len, good.device_traces)) - 1
    for h in snap.histories.values():
        assert 0 <= h.peak_reserved <= 2 ** 50


def test_the_summary_says_what_was_left_out(tmp_path: Path) -> None:
    a = audit("analyze", str(spoilt(tmp_path, 2 ** 70)), out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    assert "spoilt.pickle: 2 entries with sizes no device has were left out (the first: a segment: total_size " \
           "1.18e+21)" in a.stdout
    assert (a.out / "report.html").is_file() and (a.out / "findings.json").is_file()
