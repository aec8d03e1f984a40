"""The Kineto trace parser against recorded GPU traces, checked against the raw JSON read with the
standard library (never through the parser), plus malformed inputs and the chunked scanner."""
from __future__ import annotations

import gzip
import json
import os
import sys
import threading
from collections import Counter
from functools import cache
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from auditor.evidence.trace import load as trace_load
from auditor.evidence.trace import parallel as trace_parallel
from auditor.evidence.errors import InputError
from auditor.evidence.trace.decode import CAT, CATEGORIES
from auditor.evidence.trace.load import load_trace

from conftest import FIXTURES

TRACES = FIXTURES / "traces"
ALL = sorted(p.name for p in TRACES.glob("*.pt.trace.json.gz"))

RAW_TO_CAT = {"cpu_op": "cpu_op", "Operator": "cpu_op", "user_annotation": "annotation",
              "python_function": "python", "cuda_runtime": "runtime", "Runtime": "runtime",
              "cuda_driver": "driver", "kernel": "kernel", "Kernel": "kernel", "gpu_memcpy": "memcpy",
              "Memcpy": "memcpy", "gpu_memset": "memset", "Memset": "memset",
              "gpu_user_annotation": "gpu_annotation", "cuda_sync": "sync"}


@cache
def raw(name: str) -> dict:
    with gzip.open(TRACES / name, "rt") as f:
        return json.load(f)


@cache
def parsed(name: str):
    return load_trace(TRACES / name)


def test_fixtures_present() -> None:
    assert len(ALL) == 7, ALL


@pytest.mark.parametrize("name", ALL)
def test_counts_per_category_match_raw(name: str) -> None:
    events = raw(name)["traceEvents"]
    want = Counter(RAW_TO_CAT[e["cat"]] for e in events if e.get("ph") == "X" and e.get("cat") in RAW_TO_CAT)
    want["memory"] = sum(1 for e in events if e.get("ph") == "i" and e.get("name") == "[memory]")
    got = Counter(CATEGORIES[c] for c in parsed(name).events["cat"])
    for cat, n in want.items():
        assert got[cat] == n, (cat, got[cat], n)
    flows = sum(1 for e in events if e.get("ph") in ("s", "f"))
    assert len(parsed(name).flows) == flows


@pytest.mark.parametrize("name", ALL)
def test_metadata_steps_and_device(name: str) -> None:
    doc = raw(name)
    trace = parsed(name)
    assert set(trace.metadata) == set(doc) - {"traceEvents"}
    assert trace.device_properties == doc["deviceProperties"]
    steps = sorted((e["ts"], e["dur"], int(e["name"].split("#")[1])) for e in doc["traceEvents"]
                   if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")
                   and e.get("cat") in ("user_annotation", "Operator"))
    assert [(float(t), float(d), n) for t, d, n in steps] == \
        list(zip(trace.steps["ts"], trace.steps["dur"], trace.steps["step"]))


@pytest.mark.parametrize("name", ALL)
def test_correlation_links_match_raw(name: str) -> None:
    events = raw(name)["traceEvents"]
    launch = {e["args"]["correlation"] for e in events
              if e.get("cat") in ("cuda_runtime", "Runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    gpu = [e for e in events if e.get("cat") in ("kernel", "Kernel", "gpu_memcpy", "Memcpy", "gpu_memset",
                                                  "Memset", "cuda_sync") and e.get("ph") == "X"]
    linked = sum(1 for e in gpu if e.get("args", {}).get("correlation") in launch)
    ev = parsed(name).events
    gpu_rows = ev[ev["cat"].isin([CAT[c] for c in ("kernel", "memcpy", "memset", "sync")])]
    assert int((gpu_rows["link"] >= 0).sum()) == linked
    # a linked GPU row and its launch call share the correlation id
    lk = gpu_rows[gpu_rows["link"] >= 0]
    assert (ev["correlation"].to_numpy()[lk["link"].to_numpy()] == lk["correlation"].to_numpy()).all()


def test_old_schema_v100() -> None:
    trace = parsed("v100_resnet50_dataloader_workers0.pt.trace.json.gz")
    assert trace.schema == "old"
    kernels = trace.of("kernel")
    assert set(kernels["tid"]) == {7}  # tid "stream 7"
    assert (kernels["external_id"] >= 0).all()  # lower-case "external id"
    assert trace.has_stacks  # the old "Call stack" argument
    assert parsed("h100_owlv2_syncs_dataloader.pt.trace.json.gz").schema == "new"


def test_every_event_gets_its_step() -> None:
    name = "v100_resnet50_dataloader_workers0.pt.trace.json.gz"
    doc = raw(name)["traceEvents"]
    steps = [(e["ts"], e["ts"] + e["dur"], int(e["name"].split("#")[1])) for e in doc
             if str(e.get("name", "")).startswith("ProfilerStep#")]
    ev = parsed(name).events
    ops = ev[ev["cat"] == CAT["cpu_op"]]
    for ts, step in zip(ops["ts"].to_numpy()[::97], ops["step"].to_numpy()[::97]):
        want = next((n for s, e, n in steps if s <= ts < e), -1)
        assert step == want
    # kernels take the step of the call that launched them
    k = ev[(ev["cat"] == CAT["kernel"]) & (ev["link"] >= 0)]
    assert (k["step"].to_numpy() == ev["step"].to_numpy()[k["link"].to_numpy()]).all()


def _raw_enclosing(events: list[dict], target: dict, cats: tuple[str, ...]) -> list[str]:
    inside = [e for e in events if e.get("ph") == "X" and e.get("cat") in cats and e["tid"] == target["tid"]
              and e["pid"] == target["pid"] and e["ts"] <= target["ts"] and e["ts"] + e["dur"] > target["ts"]
              and e is not target]
    return [e["name"] for e in sorted(inside, key=lambda e: -e["ts"])]


def test_parent_chain_of_item_sync() -> None:
    name = "h100_bert_small_item_sync.pt.trace.json.gz"
    events = raw(name)["traceEvents"]
    sync = next(e for e in events if e.get("name") == "cudaStreamSynchronize")
    want = _raw_enclosing(events, sync, ("cpu_op",))
    trace = parsed(name)
    row = int(trace.named("cudaStreamSynchronize").index[0])
    assert trace.op_chain(row) == want
    assert "aten::_local_scalar_dense" in want and "aten::item" in want


def test_user_frame_from_python_events() -> None:
    name = "h100_owlv2_syncs_dataloader.pt.trace.json.gz"
    events = raw(name)["traceEvents"]
    longest = max((e for e in events if e.get("name") == "cudaStreamSynchronize"), key=lambda e: e["dur"])
    frames = _raw_enclosing(events, longest, ("python_function",))
    trace = parsed(name)
    syncs = trace.named("cudaStreamSynchronize")
    row = int(syncs.index[np.argmax(syncs["dur"].to_numpy())])
    frame = trace.user_frame(row)
    assert frame is not None
    text = f"{frame.file}({frame.line}): {frame.function}"
    assert text in frames
    # every frame inside it (nearer the sync) is torch, the standard library or a built-in
    for inner in frames[:frames.index(text)]:
        assert inner.startswith(("torch/", "<built-in")), inner


def test_user_frame_from_old_call_stack() -> None:
    trace = parsed("v100_resnet50_dataloader_workers0.pt.trace.json.gz")
    row = int(trace.of("memcpy").index[0])
    frame = trace.user_frame(row)
    assert frame is not None and frame.file == "resnet50_profiler_api.py"
    events = raw("v100_resnet50_dataloader_workers0.pt.trace.json.gz")["traceEvents"]
    stacks = {e["args"]["Call stack"] for e in events if "Call stack" in e.get("args", {})}
    assert any(f"resnet50_profiler_api.py({frame.line}): " in s for s in stacks)


@pytest.fixture(scope="module")
def plain_copy(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plain") / "v100.pt.trace.json"
    with gzip.open(TRACES / "v100_resnet50_dataloader_workers4.pt.trace.json.gz", "rb") as f:
        out.write_bytes(f.read())
    return out


def test_gz_and_plain_and_chunk_sizes_agree(plain_copy: Path) -> None:
    gz = parsed("v100_resnet50_dataloader_workers4.pt.trace.json.gz")
    plain = load_trace(plain_copy)
    tiny = load_trace(plain_copy, chunk_bytes=64 << 10)  # hundreds of chunks: exercises the scanner
    for other in (plain, tiny):
        _assert_same_trace(gz, other)


def test_braces_inside_strings_and_nested_objects(tmp_path: Path) -> None:
    events = [{"ph": "X", "cat": "cuda_runtime", "name": "weird},{name" + str(i) + "}, {", "pid": 1, "tid": 1,
               "ts": i * 10, "dur": 5, "args": {"nested": [{"a": "}]"}, {"b": [1, {"c": "},{"}]}],
                                               "correlation": i}} for i in range(2000)]
    path = tmp_path / "weird.json"
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events, "traceName": "x"}, indent=1))
    trace = load_trace(path, chunk_bytes=1 << 16)
    assert len(trace.events) == 2000
    assert trace.name(1999) == "weird},{name1999}, {"
    assert trace.events["correlation"].tolist() == list(range(2000))
    assert trace.metadata == {"schemaVersion": 1, "traceName": "x"}


def test_loose_values_fall_back_instead_of_failing(tmp_path: Path) -> None:
    doc = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": None, "pid": 0, "tid": "stream 7", "ts": "100", "dur": "2.5",
         "args": {"correlation": "42", "bytes": 1.0}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 5, "tid": 5, "ts": 90, "dur": 3,
         "args": {"correlation": 42}}]}
    path = tmp_path / "loose.json"
    path.write_text(json.dumps(doc))
    trace = load_trace(path)
    ev = trace.events
    assert ev["ts"].tolist() == [100.0, 90.0] and ev["dur"].tolist() == [2.5, 3.0]
    assert ev["correlation"].tolist() == [42, 42] and ev["link"].tolist() == [1, 0]
    assert ev["tid"].tolist() == [7, 5]


def test_bare_array_form(tmp_path: Path) -> None:
    path = tmp_path / "bare.json"
    path.write_text(json.dumps([{"ph": "X", "name": "a", "cat": "cpu_op", "pid": 1, "tid": 1, "ts": 1, "dur": 2}]))
    trace = load_trace(path)
    assert len(trace.events) == 1 and trace.metadata == {}


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_truncated_plain_and_gz(tmp_path: Path, plain_copy: Path) -> None:
    data = plain_copy.read_bytes()
    for cut in (len(data) // 2, len(data) - 3, 100):
        p = tmp_path / f"cut{cut}.json"
        p.write_bytes(data[:cut])
        with pytest.raises(InputError) as err:
            load_trace(p, chunk_bytes=1 << 20)
        assert str(p) in _one_line(err)
    gz = tmp_path / "cut.json.gz"
    packed = gzip.compress(data)
    gz.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(InputError) as err:
        load_trace(gz)
    _one_line(err)


@pytest.mark.parametrize("content", [b"", b"\x00\x01garbage\xff" * 100, b'{"hello": "world"}',
                                     b'{"traceEvents": [1, 2, 3]}', b'{"traceEvents": [{"ph": "X",}]}',
                                     b"not json at all"])
def test_non_traces_raise_input_error(tmp_path: Path, content: bytes) -> None:
    p = tmp_path / "bad.json"
    p.write_bytes(content)
    with pytest.raises(InputError) as err:
        load_trace(p)
    assert str(p) in _one_line(err)


@pytest.mark.parametrize("content, says", [
    (b"[1, 2, 3]", "traceEvents holds a non-object"),
    (b'[{"ph": "X"}, 2]', "traceEvents holds a non-object"),
    (b'{"traceEvents": [{"ph": "X"}, 2], "traceName": "x"}', "traceEvents holds a non-object"),
    (b'{"traceEvents": [{"ph": "X"}, {"ph": "X"', "truncated"),
    (b"[]", "holds no timed events"),
    (b'{"traceEvents": [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "x"}}]}',
     "holds no timed events"),
])
def test_valid_json_that_is_not_a_trace_is_named_so(tmp_path: Path, content: bytes, says: str) -> None:
    """JSON that parses but holds no trace is not "truncated", and an empty one does not become a
    report that says "no findings"."""
    p = tmp_path / "x.json"
    p.write_bytes(content)
    with pytest.raises(InputError) as err:
        load_trace(p)
    assert says in _one_line(err)


def test_malformed_middle_is_reported(tmp_path: Path, plain_copy: Path) -> None:
    data = bytearray(plain_copy.read_bytes())
    at = data.index(b'"ph"', len(data) // 2)
    data[at:at + 4] = b'"ph '  # an unterminated key in the middle of the events
    p = tmp_path / "broken.json"
    p.write_bytes(bytes(data))
    with pytest.raises(InputError) as err:
        load_trace(p, chunk_bytes=1 << 20)
    assert "malformed" in _one_line(err) or "truncated" in _one_line(err)


def test_missing_file() -> None:
    with pytest.raises(InputError):
        load_trace(TRACES / "no-such.pt.trace.json")


def test_nesting_matches_a_stack_sweep_over_the_raw_events() -> None:
    """Every host event's parent equals what a plain stack sweep over the raw JSON finds."""
    name = "h100_bert_small_item_sync.pt.trace.json.gz"
    host = ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver")
    events = [e for e in raw(name)["traceEvents"] if e.get("ph") == "X" and e.get("cat") in host]
    events.sort(key=lambda e: (e["pid"], e["tid"], e["ts"], -e["dur"]))
    want: Counter = Counter()
    stack: list[dict] = []
    thread = None
    for e in events:
        if (e["pid"], e["tid"]) != thread:
            thread, stack = (e["pid"], e["tid"]), []
        while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
            stack.pop()
        want[(e["name"], e["ts"], stack[-1]["name"] if stack else None)] += 1
        stack.append(e)
    trace = parsed(name)
    ev = trace.events
    rows = ev[ev["cat"].isin([CAT[c] for c in ("cpu_op", "annotation", "python", "runtime", "driver")])]
    parent = ev["parent"].to_numpy()
    got = Counter((trace.name(r), float(ev["ts"].iat[r]), trace.name(int(parent[r])) if parent[r] >= 0 else None)
                  for r in rows.index)
    assert got == Counter({(n, float(t), p): c for (n, t, p), c in want.items()})


# ---------------------------------------------------------------------------------------------
# Decoding in worker processes (trace_parallel): same Trace as one process, or a fallback to it.

SYMBOLIC = ("name", "raw_cat", "stack", "sync_kind")


def _decoded_frames(trace) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Events and flows with symbol codes turned back into strings (codes depend on the order
    names were first met, which differs with where the file was cut; the strings must not)."""
    names = np.array([*trace.symbols.names, ""], dtype=object)  # code -1 reads the last: ""
    events, flows = trace.events.copy(), trace.flows.copy()
    for c in SYMBOLIC:
        events[c] = names[events[c].to_numpy()]
    flows["cat"] = names[flows["cat"].to_numpy()]
    return events, flows


def _assert_same_trace(one, other) -> None:
    for a, b in zip(_decoded_frames(one), _decoded_frames(other)):
        pd.testing.assert_frame_equal(a, b)
    assert set(one.symbols.names) == set(other.symbols.names)
    assert (one.metadata, one.processes, one.schema) == (other.metadata, other.processes, other.schema)


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of 64 KiB, so that even a small fixture is cut into many."""
    monkeypatch.setattr(trace_parallel, "PIECE_BYTES", 64 << 10)


@pytest.mark.parametrize("name", ALL)
def test_workers_give_the_same_trace(tmp_path: Path, name: str, small_pieces: None) -> None:
    plain = tmp_path / name.removesuffix(".gz")
    plain.write_bytes(gzip.decompress((TRACES / name).read_bytes()))
    text = plain.read_bytes()
    pieces = trace_parallel.cuts(plain, text.index(b"[", text.index(b'"traceEvents"')) + 1)
    assert len(pieces) > 1 or len(text) < 3 * (64 << 10)  # cut into several pieces, unless tiny
    par = load_trace(plain, workers=2)
    assert par.workers == 2  # decoded by the workers, not by the fallback
    _assert_same_trace(load_trace(plain, workers=0), par)


@pytest.mark.parametrize("slot_bytes", [1 << 20, 256], ids=["shared", "pickled"])
def test_pieces_come_back_through_shared_memory_or_pickled(plain_copy: Path, small_pieces: None, slot_bytes: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A piece's columns come back through its slot of shared memory, or pickled where they do not
    fit in it; the trace is the same either way."""
    monkeypatch.setattr(trace_parallel, "SLOT_BYTES", slot_bytes)
    read = []
    get = trace_parallel._Slots.get
    monkeypatch.setattr(trace_parallel._Slots, "get", lambda self, layout: read.append(layout) or get(self, layout))
    par = load_trace(plain_copy, workers=2)
    assert par.workers == 2
    text = plain_copy.read_bytes()
    pieces = len(trace_parallel.cuts(plain_copy, text.index(b"[", text.index(b'"traceEvents"')) + 1))
    assert len(read) == (2 * pieces if slot_bytes > 256 else 0)  # (events and flows of each piece)
    _assert_same_trace(load_trace(plain_copy, workers=0), par)


def test_a_slot_holds_plain_columns_and_refuses_what_it_cannot() -> None:
    """Columns written into a slot read back equal, in their dtypes; columns too large for it, of
    mixed dtypes across chunks or of Python objects are refused (they come back pickled)."""
    ints, floats = np.arange(5, dtype=np.int32), np.linspace(0, 1, 7)
    with trace_parallel._Slots(2, 1024) as slots:
        layout = slots.put(1, [{"a": [ints, ints[:2]], "b": [floats]}, {"c": [np.array([True, False])]}])
        events, flows = (slots.get(part) for part in layout)
        assert events["a"].dtype == np.int32 and events["a"].tolist() == [*ints.tolist(), 0, 1]
        assert events["b"].tolist() == floats.tolist() and flows["c"].tolist() == [True, False]
        assert all(at >= 1024 and at % slots.ALIGN == 0 for part in layout for _, _, at, _ in part)  # (slot 1)
        del events, flows
        assert slots.put(0, [{"a": [np.zeros(200)]}]) is None  # 1,600 bytes
        assert slots.put(0, [{"a": [ints, ints.astype(np.int64)]}]) is None
        assert slots.put(0, [{"a": [np.array(["x"], dtype=object)]}]) is None


def test_a_cut_inside_a_string_falls_back_to_one_process(tmp_path: Path, small_pieces: None) -> None:
    # Every name ends with `}, {`: a cut searched from an arbitrary offset nearly always lands in one.
    events = [{"ph": "X", "cat": "cpu_op", "name": "n" * 400 + str(i) + "}, {", "pid": 1, "tid": 1,
               "ts": i * 10, "dur": 5} for i in range(1500)]
    path = tmp_path / "cuts.json"
    path.write_text(json.dumps({"traceEvents": events, "traceName": "t"}))
    par = load_trace(path, workers=2)
    assert par.workers == 0  # a worker met half an event and the file was parsed again in one process
    _assert_same_trace(load_trace(path, workers=0), par)
    assert par.name(1499) == "n" * 400 + "1499}, {"


def test_workers_fill_columns_past_their_first_estimate(tmp_path: Path, small_pieces: None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The main process copies each piece into columns sized from the rows per byte seen so far: a
    file whose first events are long (few rows per byte) and whose later ones are short outgrows
    that estimate, and the columns grow without losing or reordering a row."""
    events = [{"ph": "X", "cat": "cpu_op", "name": ("long" * 100 if i < 300 else "s") + str(i), "pid": 1,
               "tid": 1 + i % 3, "ts": i * 10, "dur": 25 if i % 4 == 0 else 5} for i in range(9000)]
    path = tmp_path / "dense_later.json"
    path.write_text(json.dumps({"traceEvents": events, "traceName": "t"}))
    grown = []
    resize = trace_parallel._Filling._resize
    monkeypatch.setattr(trace_parallel._Filling, "_resize",
                        lambda self, capacity, parts: (grown.append(self.rows), resize(self, capacity, parts)))
    par = load_trace(path, workers=2)
    assert par.workers == 2
    assert [r for r in grown if r > 0]  # grew past its first estimate, with rows already in it
    _assert_same_trace(load_trace(path, workers=0), par)
    assert par.name(8999) == "s8999" and len(par.events) == 9000


def test_the_parse_makes_its_columns_without_the_huge_page_hint(tmp_path: Path, plain_copy: Path, small_pieces: None,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """numpy's transparent-huge-page hint is off while a trace is parsed (in this process and in the
    workers forked from it) and as it was after, also when the parse fails."""
    from numpy._core.multiarray import _set_madvise_hugepage as hint
    seen = []

    def nest(*columns):  # (hint(False) answers what the hint was, and leaves it off)
        seen.append(hint(False))
        return real_nest(*columns)

    real_nest = trace_load.nest
    monkeypatch.setattr(trace_load, "nest", nest)
    numpys = hint(True)
    for was in (True, False):
        hint(was)
        try:
            assert load_trace(plain_copy, workers=2).workers == 2
            assert hint(was) is was  # restored
            broken = tmp_path / "broken.json"
            broken.write_bytes(plain_copy.read_bytes()[: plain_copy.stat().st_size // 2])
            with pytest.raises(InputError):
                load_trace(broken, workers=2)
            assert hint(was) is was
        finally:
            hint(numpys)
    assert seen == [False, False]


def test_a_numpy_without_its_huge_page_switch_parses_as_before(plain_copy: Path, small_pieces: None,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The switch is numpy's private one: where a numpy has none, the parse runs with its default."""
    import numpy._core.multiarray as multiarray
    monkeypatch.delattr(multiarray, "_set_madvise_hugepage")
    with pytest.raises(ImportError):
        from numpy._core.multiarray import _set_madvise_hugepage  # noqa: F401
    assert load_trace(plain_copy, workers=2).workers == 2


@pytest.mark.parametrize("damage", ["malformed", "truncated"])
def test_workers_report_damage_as_one_process_does(tmp_path: Path, plain_copy: Path, small_pieces: None,
                                                   damage: str) -> None:
    data = bytearray(plain_copy.read_bytes())
    if damage == "malformed":
        at = data.index(b'"ph"', len(data) // 2)
        data[at:at + 4] = b'"ph '
    else:
        data = data[: len(data) * 2 // 3]
    p = tmp_path / "damaged.json"
    p.write_bytes(bytes(data))
    with pytest.raises(InputError) as one:
        load_trace(p, workers=0)
    with pytest.raises(InputError) as par:
        load_trace(p, workers=2)
    assert _one_line(par) == _one_line(one)


def test_worker_count(tmp_path: Path, plain_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    # (threads an earlier test left in this process, a dask client's, are not this test's subject)
    threads = trace_parallel.threading.active_count
    monkeypatch.setattr(trace_parallel.threading, "active_count", lambda: 1)
    assert trace_parallel.worker_count(plain_copy) == 0  # small: one process
    monkeypatch.setattr(trace_parallel, "PARALLEL_MIN_BYTES", 0)
    expected = min(cores, trace_parallel.MAX_WORKERS) if cores > 1 and sys.platform == "linux" else 0
    assert trace_parallel.worker_count(plain_copy) == expected
    assert trace_parallel.worker_count(TRACES / ALL[0]) == 0  # gzip: no random access
    assert load_trace(TRACES / ALL[0], workers=2).workers == 0  # (asked anyway: parsed in one process)
    monkeypatch.setattr(trace_parallel.threading, "active_count", threads)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:  # forking a process that runs another thread is unsafe
        assert trace_parallel.worker_count(plain_copy) == 0
    finally:
        stop.set()
        other.join()


def test_an_event_larger_than_the_cut_window(tmp_path: Path, small_pieces: None) -> None:
    # A 3 MB argument (a long stack) where a cut is searched: the cut moves past it.
    events = [{"ph": "X", "cat": "cpu_op", "name": f"op{i}", "pid": 1, "tid": 1, "ts": i * 10, "dur": 5,
               "args": {"Call stack": "f.py(1): g;" * (300_000 if i == 300 else 1)}} for i in range(2000)]
    path = tmp_path / "big_event.json"
    path.write_text(json.dumps({"traceEvents": events}))
    par = load_trace(path, workers=2)
    assert par.workers == 2 and len(par.events) == 2000
    _assert_same_trace(load_trace(path, workers=0), par)
