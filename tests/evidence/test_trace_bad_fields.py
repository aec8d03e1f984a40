"""A trace whose events carry fields of the wrong type (a list for a tid, a word for a time): such
an event was read with a made-up thread or time, and a trace of nothing else was audited as empty
('0 step(s) / no findings', exit 0). Now the event is left out and counted: the report says how
many and why, and a trace with nothing usable left is an input error (one line, exit 2). The
damaged traces are a recorded GPU trace (the V100 fixture) with some of its events spoilt here,
and the explorer's repro; expected numbers come from the raw JSON."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from conftest import FIXTURES, audit

from auditor.evidence.trace import parallel as trace_parallel
from auditor.evidence.trace.load import load_trace

V100 = FIXTURES / "traces" / "v100_resnet50_dataloader_workers0.pt.trace.json.gz"
pytestmark = pytest.mark.skipif(not V100.is_file(), reason=f"recorded traces not found at {V100}")


def spoilt(tmp_path: Path) -> tuple[Path, int, str]:
    """The V100 trace with its first ProfilerStep's tid made a list and two kernels' ts a word:
    (the file, the ProfilerSteps left, how the first spoilt event is named: `ProfilerStep#N: "tid"
    is [T]`)."""
    doc = json.loads(gzip.decompress(V100.read_bytes()))
    events = doc["traceEvents"]
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#") and e.get("ph") == "X"]
    first = steps[0]
    first["tid"] = [first["tid"]]
    kernels = [e for e in events if e.get("cat") == "Kernel"]
    for e in kernels[:2]:
        e["ts"] = "soon"
    path = tmp_path / "spoilt.pt.trace.json"
    path.write_text(json.dumps(doc))
    return path, len(steps) - 1, f'{first["name"]}: "tid" is {json.dumps(first["tid"], separators=(",", ":"))}'



def test_some_events_of_the_wrong_type_are_left_out_and_said(tmp_path: Path) -> None:
    """Three events spoilt in a recorded trace of 6 ProfilerSteps: the spoilt step is not a step
    (it was read on a thread -1), and the report says what was left out (it said nothing)."""
    path, steps_left, first = spoilt(tmp_path)
    a = audit("analyze", str(path), out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    doc = a.findings_doc
    assert doc["steps"]["count"] == steps_left == 5
    note = f"spoilt.pt.trace.json: 3 events with fields of the wrong type were left out (the first: {first})"
    assert note in doc["environment"]["notes"]
    assert note.replace('"', "&#34;") in (tmp_path / "out" / "report.html").read_text()


def test_a_trace_with_nothing_usable_left_is_an_input_error(tmp_path: Path) -> None:
    """The explorer's repro: one ProfilerStep whose tid is a list. It read '0 step(s) / no
    findings', exit 0."""
    path = tmp_path / "bad_field_types.json"
    path.write_text('{"traceEvents": [{"ph":"X","name":"ProfilerStep#1","ts":1,"dur":5,"pid":"a","tid":[1]}]}\n')
    a = audit("analyze", str(path), out=tmp_path / "out")
    assert a.returncode == 2
    assert a.stderr.strip().splitlines() == [
        f'audit: error: {path}: not a usable profiler trace: 1 event with fields of the wrong type was left out '
        f'(the first: ProfilerStep#1: "tid" is [1]), and no other timed events are left']
    assert not (tmp_path / "out" / "findings.json").exists()


def test_values_that_read_as_their_type_are_kept_without_a_word(tmp_path: Path) -> None:
    """The clean case: numbers written as strings, an integral float pid, a label pid ("Spans"),
    a null name are what they say, and nothing is left out."""
    path = tmp_path / "loose.json"
    path.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": None, "pid": 1.0, "tid": "7", "ts": "100", "dur": "2.5"},
        {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": "PyTorch Profiler",
         "ts": 90, "dur": 30}]}))
    trace = load_trace(path)
    assert trace.dropped == "" and len(trace.events) == 2
    assert trace.events["ts"].tolist() == [100.0, 90.0] and trace.events["pid"].tolist()[0] == 1


def test_workers_count_what_they_leave_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A large trace is decoded by worker processes, each its own pieces: the count and the first
    reason are the whole file's, as one process gives them."""
    monkeypatch.setattr(trace_parallel, "PIECE_BYTES", 64 << 10)
    path, _, _ = spoilt(tmp_path)
    one, par = load_trace(path, workers=0), load_trace(path, workers=2)
    assert par.workers == 2 and par.dropped == one.dropped and one.dropped.startswith("3 events")
    assert len(par.events) == len(one.events)
