"""CUDA memory snapshots: safe loading, the figures derived at load, and the history replay.

Figures are checked against sums the tests compute straight from the raw pickle dicts (loaded with
the same refuse-every-global unpickler, nothing else shared), on snapshots recorded on real GPUs.
"""
from __future__ import annotations

import functools
import io
import os
import pickle
import time
from pathlib import Path

import pytest

from auditor.evidence.errors import InputError
from auditor.evidence.snapshot import (AUTOGRAD_FILE, GiB, MiB, Snapshot, StackFrame, _SafeUnpickler, live_at,
                                       load_snapshot, owners, reserved_at, user_frame)

from conftest import FIXTURES

SNAPSHOTS = FIXTURES / "snapshots"
FRAGMENTED = SNAPSHOTS / "fragmented_72gb_state_only.pickle"
TRANSFORMER = SNAPSHOTS / "transformer_fullstep_with_history.pickle"
LLAMA = SNAPSHOTS / "llama_mostly_free_segments.pickle"
ALL = [FRAGMENTED, TRANSFORMER, LLAMA]



def raw(path: Path) -> dict:
    """The pickle as plain dicts, a fresh copy each call (tests edit them)."""
    return _SafeUnpickler(io.BytesIO(path.read_bytes())).load()


@functools.cache
def snapshot(path: Path) -> Snapshot:
    """A fixture loaded once per session; tests only read it."""
    return load_snapshot(path)


# ------------------------------------------------------------------------------------------------
# Figures against the raw dicts


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.stem)
def test_figures_match_raw_sums(path: Path) -> None:
    d = raw(path)
    snap = snapshot(path)
    segs = d["segments"]
    blocks = [(s, b) for s in segs for b in s["blocks"]]
    free = [b["size"] for _, b in blocks if b["state"] == "inactive"]
    t = snap.totals
    assert t.segments == len(segs)
    assert t.reserved == sum(s["total_size"] for s in segs)
    assert t.allocated == sum(s["allocated_size"] for s in segs)
    assert t.active == sum(s["active_size"] for s in segs)
    assert t.free == sum(free) == t.reserved - t.active
    assert t.largest_free == max(free)
    assert t.free_blocks == len(free)
    assert t.requested == sum(b["requested_size"] for _, b in blocks if b["state"] == "active_allocated")
    assert t.empty_segments == sum(1 for s in segs if s["active_size"] == 0)
    assert t.free_in_empty_segments == sum(s["total_size"] for s in segs if s["active_size"] == 0)
    assert t.free_in_split_segments == t.free - t.free_in_empty_segments
    for pool in ("small", "large"):
        mine = [s for s in segs if s["segment_type"] == pool]
        assert t.by_pool[pool].reserved == sum(s["total_size"] for s in mine)
        assert t.by_pool[pool].free == sum(b["size"] for s in mine for b in s["blocks"] if b["state"] == "inactive")
    assert set(t.by_stream) == {s["stream"] for s in segs}
    assert set(snap.devices) == {s["device"] for s in segs}
    assert sum(f.reserved for f in snap.devices.values()) == t.reserved


def test_fragmented_fixture_is_what_the_readme_says() -> None:
    """The README's "72.4 / 52.5 / 19.9" are thousands of MiB; in GiB they are 70.7 / 51.3 / 19.4."""
    t = snapshot(FRAGMENTED).totals
    assert t.segments == 1457
    assert (round(t.reserved / MiB / 1000, 1), round(t.allocated / MiB / 1000, 1), round(t.free / MiB / 1000, 1)) \
        == (72.4, 52.5, 19.9)
    assert t.largest_free == 314 * MiB
    assert snapshot(FRAGMENTED).allocator_settings.expandable_segments is False


def test_older_format_without_allocator_settings() -> None:
    snap = snapshot(LLAMA)
    assert snap.allocator_settings is None
    assert "no allocator_settings" in snap.notes
    assert set(snap.devices) == {1}  # recorded on the second GPU
    assert snap.histories == {}  # four empty device traces


# ------------------------------------------------------------------------------------------------
# History replay


def _prefix_replay(d: dict, device: int = 0) -> tuple[int, int, int, int, int]:
    """(start, peak, peak index, end) of allocated bytes, and the peak of reserved, by prefix sums
    from the final state backwards: start = live at end - allocs + frees."""
    trace = d["device_traces"][device]
    segs = [s for s in d["segments"] if s["device"] == device]
    live_end = sum(b["requested_size"] for s in segs for b in s["blocks"] if b["state"] != "inactive")
    deltas = [e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
              for e in trace]
    start = live_end - sum(deltas)
    cur, peak, peak_i = start, start, -1
    for i, dlt in enumerate(deltas):
        cur += dlt
        if cur > peak:
            peak, peak_i = cur, i
    r_deltas = [e["size"] if e["action"] in ("segment_alloc", "segment_map") else
                -e["size"] if e["action"] in ("segment_free", "segment_unmap") else 0 for e in trace]
    r = sum(s["total_size"] for s in segs) - sum(r_deltas)
    r_peak = r
    for dlt in r_deltas:
        r += dlt
        r_peak = max(r_peak, r)
    return start, peak, peak_i, cur, r_peak


def test_history_replay_matches_prefix_sums() -> None:
    d = raw(TRANSFORMER)
    snap = snapshot(TRANSFORMER)
    h = snap.histories[0]
    start, peak, peak_i, end, r_peak = _prefix_replay(d)
    assert (h.start_allocated, h.peak_allocated, h.peak_allocated_index, h.end_allocated) == (start, peak, peak_i, end)
    assert h.peak_reserved == r_peak
    assert h.entries == len(d["device_traces"][0]) == 19342
    assert h.actions == {"alloc": 6771, "free_completed": 5894, "free_requested": 5894, "segment_alloc": 783}
    assert h.end_reserved == sum(s["total_size"] for s in d["segments"])
    assert reserved_at(snap, 0, len(d["device_traces"][0]) - 1) == h.end_reserved
    assert reserved_at(snap, 0, -1) == h.start_reserved


def test_live_at_peak_adds_up_and_names_the_owning_lines() -> None:
    d = raw(TRANSFORMER)
    snap = snapshot(TRANSFORMER)
    h = snap.histories[0]
    live = live_at(snap, 0, h.peak_allocated_index)
    assert sum(a.size for a in live) == h.peak_allocated
    groups = owners(live)
    assert sum(g.bytes for g in groups) == h.peak_allocated
    assert [g.bytes for g in groups] == sorted((g.bytes for g in groups), reverse=True)
    # Every named owner is a frame of an alloc recorded in the raw trace, outside site-packages.
    raw_frames = {(f["filename"], f["line"]) for e in d["device_traces"][0] if e["action"] == "alloc"
                  for f in e["frames"]}
    for g in groups:
        if g.frame is not None and not g.frame.filename.startswith("<"):
            assert (g.frame.filename, g.frame.line) in raw_frames
            assert "site-packages" not in g.frame.filename
    # What was live before recording began has no stack: its bytes are the replay's start minus
    # whatever of it was freed before the peak.
    unknown = sum(a.size for a in live if a.since == -1)
    assert unknown <= h.start_allocated
    assert next(g.bytes for g in groups if g.frame is None) == unknown


def test_live_at_start_and_end() -> None:
    snap = snapshot(TRANSFORMER)
    h = snap.histories[0]
    assert sum(a.size for a in live_at(snap, 0, -1)) == h.start_allocated
    assert sum(a.size for a in live_at(snap, 0, h.entries - 1)) == h.end_allocated


# ------------------------------------------------------------------------------------------------
# Owning frames


def F(filename: str, line: int, name: str = "f") -> StackFrame:
    return StackFrame(name=name, filename=filename, line=line)


CPP = F("CUDACachingAllocator.cpp", 0, "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc")


@pytest.mark.parametrize("frames, expected", [
    ([CPP, F("/home/u/model.py", 39), F("/home/u/train.py", 10)], ("/home/u/model.py", 39)),
    ([CPP, F("/venv/lib/python3.13/site-packages/torch/nn/modules/module.py", 1750), F("/home/u/train.py", 12)],
     ("/home/u/train.py", 12)),
    ([F("<frozen runpy>", 88), F("/home/u/train.py", 7)], ("/home/u/train.py", 7)),
    ([F("/usr/lib/python3.11/contextlib.py", 81), F("/home/u/train.py", 3)], ("/home/u/train.py", 3)),
    ([F("/venv/lib/python3.11/site-packages/torch/a.py", 1), F("/venv/lib/python3.11/site-packages/lightning/l.py", 5)],
     ("/venv/lib/python3.11/site-packages/lightning/l.py", 5)),  # framework code: the first non-torch frame
    ([F("/venv/lib/python3.11/site-packages/torch/a.py", 1), F("/usr/lib/python3.11/threading.py", 5)], None),
    ([CPP, F("??", 0, "_start")], None),
    ([], None),
])
def test_user_frame(frames: list[StackFrame], expected: tuple[str, int] | None) -> None:
    got = user_frame(frames)
    assert (None if got is None else (got.filename, got.line)) == expected


def test_backward_allocations_are_owned_by_their_autograd_node() -> None:
    snap = snapshot(TRANSFORMER)
    trace = snap.device_traces[0]
    bmm = [e for e in trace if e.action == "alloc"
           and any("BmmBackward0::apply" in f.name for f in e.frames)
           and not any(f.filename.endswith(".py") for f in e.frames)]
    assert bmm, "the fixture's backward pass allocates under BmmBackward0"
    assert {e.owner for e in bmm} == {StackFrame(name="BmmBackward0 (backward)", filename=AUTOGRAD_FILE, line=0)}


# ------------------------------------------------------------------------------------------------
# Safety and damaged input


class _RunsCode:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_pickle_that_would_run_code_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps({"segments": [], "x": _RunsCode(f"touch {marker}")}, protocol=4))
    with pytest.raises(InputError) as e:
        load_snapshot(evil)
    assert not marker.exists()
    # The control: the same kind of payload does run under a plain unpickler.
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(_RunsCode(f"touch {control}"), protocol=4))
    assert control.exists()
    msg = str(e.value)
    assert "\n" not in msg and "system" in msg and "refused" in msg


def test_every_global_is_refused_even_harmless_ones(tmp_path: Path) -> None:
    from collections import OrderedDict

    p = tmp_path / "od.pickle"
    p.write_bytes(pickle.dumps({"segments": [], "device_traces": [OrderedDict(a=1)]}, protocol=5))
    with pytest.raises(InputError, match="collections.OrderedDict"):
        load_snapshot(p)


@pytest.mark.parametrize("make", [
    lambda good: good[: len(good) // 2],  # truncated
    lambda good: good[:-1],  # missing STOP
    lambda good: b"",  # empty
    lambda good: b"segments,device_traces\n1,2\n",  # not a pickle
    lambda good: bytes(range(256)) * 4,  # garbage
    lambda good: b"\x80\x04" + bytes(200),  # pickle header then garbage
    lambda good: pickle.dumps([1, 2, 3], protocol=4),  # a pickle, not a snapshot
    lambda good: pickle.dumps({"segments": "nope"}, protocol=4),
    lambda good: pickle.dumps({"segments": [], "device_traces": 5}, protocol=4),
], ids=["truncated", "no-stop", "empty", "csv", "garbage", "header-garbage", "list", "bad-segments", "bad-traces"])
def test_damaged_files_raise_input_error(tmp_path: Path, make) -> None:
    p = tmp_path / "bad.pickle"
    p.write_bytes(make(LLAMA.read_bytes()))
    with pytest.raises(InputError) as e:
        load_snapshot(p)
    assert "\n" not in str(e.value) and str(p) in str(e.value)


def test_missing_file_raises_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="cannot read"):
        load_snapshot(tmp_path / "absent.pickle")


# ------------------------------------------------------------------------------------------------
# Formats: protocol 5, older and newer layouts


def test_protocol_5_loads_the_same(tmp_path: Path) -> None:
    p = tmp_path / "p5.pickle"
    p.write_bytes(pickle.dumps(raw(FRAGMENTED), protocol=5))
    assert load_snapshot(p).totals == snapshot(FRAGMENTED).totals


def test_legacy_layout_with_block_history_and_missing_keys(tmp_path: Path) -> None:
    """torch 2.0-style blocks (stack and real size under "history", no address, no requested_size)
    in segments lacking active/requested sizes, pool ids and expandable flags."""
    frames = [{"filename": "/home/u/train.py", "line": 21, "name": "step"}]
    d = {"segments": [{
        "device": 0, "address": 1 << 40, "total_size": 20 * MiB, "allocated_size": 12 * MiB, "stream": 0,
        "segment_type": "large",
        "blocks": [{"size": 12 * MiB, "state": "active_allocated",
                    "history": [{"addr": 1 << 40, "real_size": 12 * MiB - 100, "frames": frames}]},
                   {"size": 8 * MiB, "state": "inactive"}]}],
         "device_traces": [[]]}
    p = tmp_path / "legacy.pickle"
    p.write_bytes(pickle.dumps(d, protocol=4))
    snap = load_snapshot(p)
    seg = snap.segments[0]
    assert [b.address for b in seg.blocks] == [1 << 40, (1 << 40) + 12 * MiB]
    assert seg.blocks[0].requested_size == 12 * MiB - 100
    assert seg.blocks[0].owner == StackFrame(name="step", filename="/home/u/train.py", line=21)
    assert (seg.active_size, seg.free_size, seg.largest_free) == (12 * MiB, 8 * MiB, 8 * MiB)
    assert "legacy block history" in snap.notes and "segments without active_size" in snap.notes
    assert snap.totals.free == 8 * MiB


def test_bare_segment_list_from_torch_1_13(tmp_path: Path) -> None:
    p = tmp_path / "old.pickle"
    p.write_bytes(pickle.dumps(raw(LLAMA)["segments"], protocol=4))
    assert load_snapshot(p).totals == snapshot(LLAMA).totals


def test_newer_actions_are_kept_and_do_not_disturb_the_replay(tmp_path: Path) -> None:
    d = raw(TRANSFORMER)
    trace = d["device_traces"][0]
    base = snapshot(TRANSFORMER).histories[0]
    t0 = trace[0]["time_us"]
    extra = [
        {"action": "annotate", "addr": 0, "size": 0, "stream": 0, "time_us": t0, "frames": [],
         "user_metadata": "epoch=3"},
        {"action": "user_metadata", "addr": 0, "size": 0, "stream": 0, "time_us": t0, "frames": []},
        {"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "time_us": t0, "frames": []},
    ]
    trace[0]["compile_context"] = "[0/0] torch/_inductor"
    trace[:0] = extra
    p = tmp_path / "new.pickle"
    p.write_bytes(pickle.dumps(d, protocol=5))
    snap = load_snapshot(p)
    h = snap.histories[0]
    assert h.entries == base.entries + 3
    assert (h.start_allocated, h.peak_allocated, h.end_allocated) == (base.start_allocated, base.peak_allocated,
                                                                      base.end_allocated)
    assert h.peak_allocated_index == base.peak_allocated_index + 3
    assert snap.device_traces[0][0].user_metadata == "epoch=3"
    assert snap.device_traces[0][3].compile_context == "[0/0] torch/_inductor"
    assert "trace action 'annotate'" in snap.notes


def test_expandable_segment_map_and_unmap_move_reserved(tmp_path: Path) -> None:
    base = 1 << 40
    d = {"segments": [{"device": 0, "address": base, "total_size": 64 * MiB, "allocated_size": 0, "active_size": 0,
                       "requested_size": 0, "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
                       "is_expandable": True, "frames": [],
                       "blocks": [{"address": base, "size": 64 * MiB, "requested_size": 0, "state": "inactive",
                                   "frames": []}]}],
         "device_traces": [[
             {"action": "segment_map", "addr": base, "size": 96 * MiB, "stream": 0, "frames": []},
             {"action": "alloc", "addr": base, "size": 90 * MiB, "stream": 0, "frames": []},
             {"action": "free_requested", "addr": base, "size": 90 * MiB, "stream": 0, "frames": []},
             {"action": "free_completed", "addr": base, "size": 90 * MiB, "stream": 0, "frames": []},
             {"action": "segment_unmap", "addr": base + 64 * MiB, "size": 32 * MiB, "stream": 0, "frames": []},
         ]],
         "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "expandable_segments": True,
                                "max_split_size": -1, "garbage_collection_threshold": 0.0}}
    p = tmp_path / "exp.pickle"
    p.write_bytes(pickle.dumps(d, protocol=4))
    snap = load_snapshot(p)
    h = snap.histories[0]
    assert (h.start_reserved, h.peak_reserved, h.end_reserved) == (0, 96 * MiB, 64 * MiB)
    assert (h.start_allocated, h.peak_allocated, h.end_allocated) == (0, 90 * MiB, 0)
    assert snap.expandable and snap.allocator_settings.max_split_size is None


def test_load_is_fast_enough_for_the_largest_fixture() -> None:
    import time

    t = time.perf_counter()
    load_snapshot(TRANSFORMER)
    assert time.perf_counter() - t < 5.0  # 3 MB, 19k trace entries of ~40 frames


# ------------------------------------------------------------------------------------------------
# Capture helpers (CUDA only)


def test_cuda_helpers_are_no_ops_without_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    from auditor.capture import cuda_memory

    def must_not_run(*a, **k):
        raise AssertionError("touched the CUDA allocator without a CUDA device")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", must_not_run)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", must_not_run)
    out = tmp_path / "snap.pickle"
    assert cuda_memory.start_history() is False
    assert cuda_memory.dump_snapshot(out) is False
    assert cuda_memory.attach_oom_observer(out) is False
    assert cuda_memory.stop_history() is False
    assert not out.exists()


def test_cuda_helpers_write_snapshots_our_loader_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a device present (faked here: the CPU build has no allocator), the helpers pass the
    right arguments and the OOM observer leaves a snapshot that load_snapshot accepts."""
    torch = pytest.importorskip("torch")
    from auditor.capture import cuda_memory

    calls: list[dict] = []
    observers: list = []
    state = raw(LLAMA)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **k: calls.append(k))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: state)
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", observers.append, raising=False)

    assert cuda_memory.start_history(max_entries=1234) is True
    assert calls[-1]["enabled"] == "all" and calls[-1]["max_entries"] == 1234 and calls[-1]["stacks"] == "python"
    out = tmp_path / "oom" / "snap.pickle"
    assert cuda_memory.attach_oom_observer(out) is True
    assert not out.exists()
    observers[0](1, 2 * GiB, 5 * GiB, 100 * MiB)  # what the allocator calls on OOM
    assert load_snapshot(out).totals == snapshot(LLAMA).totals
    assert cuda_memory.dump_snapshot(tmp_path / "d.pickle") is True
    assert load_snapshot(tmp_path / "d.pickle").totals.reserved == snapshot(LLAMA).totals.reserved
    assert cuda_memory.stop_history() is True and calls[-1] == {"enabled": None}
    assert not list(tmp_path.rglob("*.tmp*"))


# ------------------------------------------------------------------------------------------------
# What the reports say about snapshots analysed on their own


def _raw_figures(path: Path) -> dict[str, int]:
    segs = raw(path)["segments"]
    free = [b["size"] for s in segs for b in s["blocks"] if b["state"] == "inactive"]
    return {"segments": len(segs), "reserved": sum(s["total_size"] for s in segs),
            "allocated": sum(s["allocated_size"] for s in segs), "free": sum(free), "largest": max(free),
            "empty": sum(s["total_size"] for s in segs if not any(b["state"] != "inactive" for b in s["blocks"]))}


def test_a_snapshot_report_leads_with_what_the_allocator_held(tmp_path: Path) -> None:
    """`audit analyze snapshot.pickle` headed its terminal summary and page as a run: '0 step(s)',
    median '-', 'no device allocator numbers' and 'How the run ended: completed', about a 70.7 GiB
    allocator state. Both now state the snapshot's reserved, allocated and free bytes."""
    import re

    from conftest import audit

    a = audit("analyze", str(FRAGMENTED), out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    r = _raw_figures(FRAGMENTED)
    gib = lambda n: f"{n / GiB:.1f} GiB"  # noqa: E731
    head = a.stdout.splitlines()[0]
    assert head == (f"audit of memory snapshot {FRAGMENTED}: {gib(r['reserved'])} reserved in {r['segments']:,} "
                    f"segments on cuda:0, {gib(r['allocated'])} allocated, {gib(r['free'])} free inside them "
                    f"(largest free block {r['largest'] / MiB:.1f} MiB)")
    assert "step(s)" not in head and head.startswith("audit of memory snapshot") and "70.7 GiB reserved" in head
    page = (tmp_path / "out" / "report.html").read_text()
    cards = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", re.search(r'<section id="verdict".*?</section>', page, re.S)[0]))
    assert f"Reserved {gib(r['reserved'])} in {r['segments']:,} segments on cuda:0" in cards
    assert f"Allocated {gib(r['allocated'])} {r['allocated'] / r['reserved']:.0%} of reserved" in cards
    assert f"Free inside segments {gib(r['free'])} largest free block {r['largest'] / MiB:.1f} MiB; {gib(r['empty'])} in wholly empty segments" in cards
    assert "Median step" not in cards and "no device allocator numbers" not in cards
    assert 'id="ending"' not in page and "How the run ended" not in page and 'id="traces"' not in page
    assert "Memory snapshot audit" in page
    # the finding says the same figures
    [f] = a.rule("allocator-fragmentation")
    assert f"{gib(r['free'])} of the {gib(r['reserved'])} reserved" in f["message"]


def test_a_run_report_still_tells_how_the_run_ended(tmp_path: Path) -> None:
    """The clean case: a run's page keeps its step cards and its ending; a trace's keeps its step
    cards but has no ending to tell (nothing ran)."""
    from auditor.reports.html import HtmlReport
    from test_reporters import make_case

    case = make_case(tmp_path)
    page = HtmlReport().render(case.evidence, case.results, case.out_dir)
    assert case.evidence.source == "run" and 'id="ending"' in page and "Median step" in page
    assert "Training-step audit" in page and "Reserved" not in page
    from auditor.evidence.load import load_paths
    from auditor.rules.engine import run_rules

    trace = load_paths([SNAPSHOTS.parent / "traces" / "a100_item_sync_small.pt.trace.json.gz"])
    page = HtmlReport().render(trace, run_rules(trace), tmp_path)
    assert "Median step" in page and 'id="traces"' in page and 'id="ending"' not in page


_BLOCK = {"address": 0, "size": 512, "requested_size": 512, "state": "active_allocated", "frames": []}


def _shared_segment(blocks: int) -> dict:
    return {"device": 0, "address": 0, "total_size": 2 << 20, "stream": 0, "segment_type": "small",
            "blocks": [_BLOCK] * blocks}


@pytest.mark.parametrize("raw", [
    {"segments": [_shared_segment(3000)] * 3000, "device_traces": []},  # 12 KB, 9 million blocks
    {"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 8}] * 3000] * 3000},
], ids=["blocks", "trace-entries"])
def test_shared_references_are_refused_by_the_file_size(tmp_path: Path, raw: dict) -> None:
    """A pickle repeats one object by reference: the work is bounded by the bytes of the file,
    not by the objects they name (this took 18 s and 1.2 GB before)."""
    p = tmp_path / "bomb.pickle"
    p.write_bytes(pickle.dumps(raw, protocol=4))
    assert p.stat().st_size < 20_000
    t0 = time.monotonic()
    with pytest.raises(InputError, match=r"not a CUDA memory snapshot: over \d+ blocks and trace entries from a \d+-byte"):
        load_snapshot(p)
    assert time.monotonic() - t0 < 2


def test_a_huge_memo_index_is_refused_without_allocating(tmp_path: Path) -> None:
    """LONG_BINPUT 2**27 in a 9-byte file: the C unpickler sized its memo by it (2 GB)."""
    p = tmp_path / "memo.pickle"
    p.write_bytes(b"\x80\x04]r" + (2**27).to_bytes(4, "little") + b".")
    with pytest.raises(InputError, match="memo index of 134217728 in a 9-byte file"):
        load_snapshot(p)


def test_fields_of_the_wrong_type(tmp_path: Path) -> None:
    """`blocks: 5` is refused with one line; `external_annotations: 7` is left out with a note."""
    p = tmp_path / "blocks.pickle"
    p.write_bytes(pickle.dumps({"segments": [dict(_shared_segment(0), blocks=5)], "device_traces": []}))
    with pytest.raises(InputError, match="blocks are of type int"):
        load_snapshot(p)
    p.write_bytes(pickle.dumps({"segments": [], "device_traces": [], "external_annotations": 7}))
    snap = load_snapshot(p)
    assert snap.external_annotations == [] and any("external_annotations" in n for n in snap.notes)


def test_a_fifo_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "fifo.pickle"
    os.mkfifo(p)
    with pytest.raises(InputError, match="not a regular file"):
        load_snapshot(p)
