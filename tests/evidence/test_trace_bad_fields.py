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

from auditor.evidence.errors import InputError
from auditor.evidence.trace import parallel as trace_parallel
from auditor.evidence.trace.load import load_trace

V100 = FIXTURES / "traces" / "v100_resnet50_dataloader_workers0.pt.trace.json.gz"


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
    note = f"spoilt.pt.trace.json: 3 events with fields of the wrong type or impossible values were left out (the first: {first})"
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
        f'audit: error: {path}: not a usable profiler trace: 1 event with fields of the wrong type or impossible values was left out '
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


# --- numbers out of range and hostile shapes: left out, or one line, never an internal error --------

def _small_trace(tmp_path: Path, spoil, extra: dict | None = None) -> Path:
    """Five ProfilerSteps, each with a launch, its kernel and a [memory] event; `spoil(events)` spoils it."""
    ev = [{"ph": "X", "name": f"ProfilerStep#{i}", "cat": "user_annotation", "pid": 1, "tid": 1,
           "ts": i * 1000, "dur": 900} for i in range(5)]
    ev += [{"ph": "X", "name": "cudaLaunchKernel", "cat": "cuda_runtime", "pid": 1, "tid": 1, "ts": i * 1000 + 10,
            "dur": 10, "args": {"correlation": i, "External id": i}} for i in range(5)]
    ev += [{"ph": "X", "name": "k", "cat": "kernel", "pid": 0, "tid": 7, "ts": i * 1000 + 30, "dur": 100,
            "args": {"correlation": i, "device": 0, "stream": 7}} for i in range(5)]
    ev += [{"ph": "i", "s": "t", "name": "[memory]", "cat": "cpu_instant_event", "pid": 1, "tid": 1,
            "ts": i * 1000 + 20, "args": {"Bytes": 1024, "Total Allocated": 1024, "Device Type": 1}} for i in range(5)]
    spoil(ev)
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": ev, **(extra or {})}))
    return path


@pytest.mark.parametrize("field,value", [("ts", "inf"), ("dur", "inf"), ("ts", "-Infinity"), ("dur", "nan"),
                                         ("ts", 10**400), ("dur", 10**400)])
def test_a_time_that_is_not_a_finite_number_is_of_the_wrong_type(tmp_path: Path, field, value) -> None:
    """`"ts": 10**400` exited 4 (OverflowError); a ts/dur of "inf" was read, giving "nan ms/step"."""
    path = _small_trace(tmp_path, lambda ev: ev[2].update({field: value}))
    trace = load_trace(path)
    assert len(trace.steps) == 4 and "1 event with fields of the wrong type or impossible values was left out" in trace.dropped
    assert f'ProfilerStep#2: "{field}"' in trace.dropped


@pytest.mark.parametrize("row,key", [(15, "Bytes"), (10, "correlation"), (10, "device"), (10, "stream"),
                                     (5, "External id")])
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e999"])
def test_an_arg_that_is_not_a_finite_number_is_left_out(tmp_path: Path, row, key, value) -> None:
    """"inf" in Bytes / correlation / device / stream exited 4 (OverflowError); now the value is
    read as absent, as any other arg that is not a number."""
    path = _small_trace(tmp_path, lambda ev: ev[row]["args"].update({key: value}))
    assert len(load_trace(path).steps) == 5


def test_args_nested_too_deeply_are_one_line(tmp_path: Path) -> None:
    """100k nested objects in an event's args exited 4 (RecursionError)."""
    path = _small_trace(tmp_path, lambda ev: None)
    deep = '{"a":' * 100_000 + "1" + "}" * 100_000
    path.write_text(path.read_text().replace('"args": {"correlation": 0, "External id": 0}', f'"args": {deep}'))
    with pytest.raises(InputError, match="nests objects or arrays too deeply") as e:
        load_trace(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("info", [{"rank": 0, "world_size": 10**20}, {"rank": 10**20, "world_size": 2},
                                  {"rank": "9" * 5000, "world_size": 2}, {"rank": True, "world_size": True}])
def test_a_rank_or_world_size_out_of_range_is_left_out(tmp_path: Path, info) -> None:
    """`"world_size": 10**20` built range(world_size) (MemoryError)."""
    from auditor.evidence.ranks.traces import ranks_from_traces, trace_rank, trace_world_size

    trace = load_trace(_small_trace(tmp_path, lambda ev: None, {"distributedInfo": info}))
    assert trace_world_size(trace) is None if info["world_size"] != 2 else trace_rank(trace) is None
    rs = ranks_from_traces([trace])
    assert rs is None or rs.missing == []
