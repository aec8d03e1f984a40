"""The parse reads a trace's names and categories through a vocabulary (decode.Vocabulary): a chunk
of names already seen is decoded as those very strings, a chunk with a new one again plainly and
learnt from, and a trace whose names keep changing is read plainly from then on. Whatever it does,
the trace is the one a plain decode gives. Counted, not timed: what the machine's load cannot move."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES

from auditor.evidence.trace import decode
from auditor.evidence.trace.load import load_trace

OWLV2 = FIXTURES / "traces" / "h100_owlv2_syncs_dataloader.pt.trace.json.gz"


def _plain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode.Vocabulary, "decode", lambda self, piece: decode._DECODER.decode(piece))


def _same(a, b) -> None:
    assert a.symbols.names == b.symbols.names
    for frame in ("events", "flows"):
        x, y = getattr(a, frame), getattr(b, frame)
        assert list(x.columns) == list(y.columns)
        for c in x.columns:
            np.testing.assert_array_equal(x[c].to_numpy(), y[c].to_numpy(), err_msg=f"{frame}.{c}")


def _chunks(path: Path, chunk_bytes: int) -> tuple[decode._Stream, list[list]]:
    stream = decode._Stream(path, chunk_bytes)
    stream.start()
    return stream, list(stream.chunks(timed=False))


def test_a_recorded_trace_is_read_through_what_its_first_chunks_taught(tmp_path: Path) -> None:
    """The OWLv2 recording (117,635 event rows) in 64 KiB chunks: after the chunks that bring new
    names (its first step's operators, kernels and frames) almost every chunk is read by the
    vocabulary's decoder, and a name read in two chunks is one string."""
    plain = tmp_path / "owlv2.json"
    plain.write_bytes(gzip.decompress(OWLV2.read_bytes()))
    stream, chunks = _chunks(plain, 1 << 16)
    vocabulary = stream.vocabulary
    assert not vocabulary.off and vocabulary.misses * 20 < vocabulary.tries
    learnt = {name: name for name in vocabulary.names}  # (a dict's keys: the strings first seen)
    known = [events for events in chunks if type(events[0]).__name__ == "_KnownEvent"]
    assert len(known) * 8 > len(chunks) * 7
    assert all(e.name is learnt[e.name] for events in known for e in events)


def test_a_trace_read_through_a_vocabulary_is_the_plain_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plain_file = tmp_path / "owlv2.json"
    plain_file.write_bytes(gzip.decompress(OWLV2.read_bytes()))
    learnt = load_trace(plain_file, chunk_bytes=1 << 16, workers=0)
    _plain(monkeypatch)
    _same(learnt, load_trace(plain_file, chunk_bytes=1 << 16, workers=0))


def test_names_that_keep_changing_are_read_plainly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Python frame's name new (a counter in each): after a miss the vocabulary waits longer
    and longer before it tries again (misses in a row: 1, 2, 4... up to MAX_WAIT chunks), stops
    once it knows MAX_WORDS names, and the trace is still the plain one."""
    doc = json.loads(gzip.decompress(OWLV2.read_bytes()))
    for i, e in enumerate(doc["traceEvents"]):
        if e.get("ph") == "X" and e.get("cat") == "python_function":
            e["name"] = f"{e['name']} #{i}"
    path = tmp_path / "renamed.json"
    path.write_text(json.dumps(doc))
    stream, chunks = _chunks(path, 1 << 16)
    vocabulary = stream.vocabulary
    assert vocabulary.off and vocabulary.decoder is None and len(vocabulary.names) > decode.Vocabulary.MAX_WORDS
    assert len(chunks) > 400 and 5 <= vocabulary.misses <= 20, vocabulary.misses
    learnt = load_trace(path, chunk_bytes=1 << 16, workers=0)
    _plain(monkeypatch)
    _same(learnt, load_trace(path, chunk_bytes=1 << 16, workers=0))


def test_profiler_steps_to_come_are_learnt_with_the_first(tmp_path: Path) -> None:
    """A ProfilerStep#N learnt brings the next steps' names: a recording of 40 steps, one chunk
    each, misses on its first chunk's new names only."""
    events = []
    for step in range(40):
        t = 1000.0 * step
        events += [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step + 3}", "pid": 1, "tid": 1,
                    "ts": t, "dur": 900.0}]
        events += [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": t + k, "dur": 1.0,
                    "args": {"pad": "x" * 200}} for k in range(1, 400)]
    path = tmp_path / "steps.json"
    path.write_text(json.dumps({"traceEvents": events}))
    stream, chunks = _chunks(path, 1 << 16)
    assert len(chunks) >= 40 and stream.vocabulary.misses == 0 and not stream.vocabulary.off
    assert load_trace(path, chunk_bytes=1 << 16, workers=0).steps["step"].tolist() == list(range(3, 43))


@pytest.mark.parametrize("chunk_bytes", [1 << 10, 1 << 20])
def test_a_number_spelt_as_text_reads_as_that_number_however_the_file_is_cut(tmp_path: Path, chunk_bytes: int) -> None:
    """Thread ids written as text ("+5", "1_000", " 7 ", "stream 9") read as int() reads them (a
    label like "Spans" as a stable negative id), whether or not a label shares their chunk."""
    tids = ["+5", "1_000", " 7 ", "stream 9", "Spans"]
    events = [{"ph": "X", "cat": "cpu_op", "name": f"op{i}", "pid": 1, "tid": tids[i % 5], "ts": float(i),
               "dur": 0.5} for i in range(400)]
    path = tmp_path / "tids.json"
    path.write_text(json.dumps({"traceEvents": events}))
    got = load_trace(path, chunk_bytes=chunk_bytes, workers=0).events["tid"].tolist()
    assert got[:4] == [5, 1000, 7, 9] and got[4] < -1000 and got[5:10] == got[:5] and got == got[:5] * 80
