"""How many passes the trace parse makes over a chunk's events, counted (what the machine's load
cannot move): events whose times cannot be used are found from the time columns the parse makes
anyway. A second pass over every event's times (_Stream._timed on every chunk) cost ~5% of the
parse of the 506 MB tiling (bench/HISTORY.md, issue 82); it now runs only on a chunk that holds
such an event, and leaves out what it left out before."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from conftest import FIXTURES

from auditor.evidence.trace import decode
from auditor.evidence.trace.load import load_trace

OWLV2 = FIXTURES / "traces" / "h100_owlv2_syncs_dataloader.pt.trace.json.gz"
ROWS = ("X", "i", "I", "B", "E", "b", "e", "n", "C")  # the phases that are rows of the events table


def _rows(doc: dict) -> int:
    return sum(e.get("ph") in ROWS for e in doc["traceEvents"])


def _count_timed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that gets the number of events of each chunk _Stream._timed is called on."""
    calls: list[int] = []
    plain = decode._Stream._timed

    def counted(self: decode._Stream, events: list) -> list:
        calls.append(len(events))
        return plain(self, events)

    monkeypatch.setattr(decode._Stream, "_timed", counted)
    return calls


def test_a_recorded_trace_is_parsed_without_a_second_pass_over_its_times(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_timed(monkeypatch)
    trace = load_trace(OWLV2, workers=0)
    assert calls == [] and trace.dropped == ""
    assert len(trace.events) == _rows(json.loads(gzip.decompress(OWLV2.read_bytes()))) == 117_635


def test_only_a_chunk_with_an_unusable_time_is_checked_event_by_event(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Two kernels of the recording spoilt (no `ts`; a duration of -5 µs): the one chunk that holds
    them is checked event by event, the two are left out and counted, the rest is read as before."""
    doc = json.loads(gzip.decompress(OWLV2.read_bytes()))
    kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
    del kernels[100]["ts"]
    kernels[101]["dur"] = -5
    path = tmp_path / "spoilt.pt.trace.json"
    path.write_text(json.dumps(doc))
    calls = _count_timed(monkeypatch)
    trace = load_trace(path, workers=0, chunk_bytes=1 << 20)
    assert len(calls) == 1 and calls[0] < len(doc["traceEvents"]) / 10
    assert trace.dropped.startswith("2 events with fields of the wrong type or impossible values were left out "
                                    '(the first: ') and trace.dropped.endswith('"ts" is missing)')
    assert len(trace.events) == _rows(doc) - 2
    kept = trace.events[trace.events["cat"] == decode.CAT["kernel"]]
    assert len(kept) == len(kernels) - 2 and (kept["dur"] >= 0).all()
