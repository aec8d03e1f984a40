"""`audit analyze` input dispatch: run directories, trace files, TensorBoard logdirs, snapshots."""
from __future__ import annotations

import gzip
import json
import pickle
from pathlib import Path

import pytest

from auditor.evidence import store
from auditor.evidence.errors import InputError
from auditor.evidence.load import find_traces, load_paths
from auditor.evidence.model import LOAD_NOTES, Evidence
from auditor.evidence.snapshot import Snapshot

from conftest import ROOT, FIXTURES

SMALL = FIXTURES / "traces" / "a100_item_sync_small.pt.trace.json.gz"
BERT = FIXTURES / "traces" / "h100_bert_small_item_sync.pt.trace.json.gz"


def raw_count(path: Path) -> int:
    with gzip.open(path, "rt") as f:
        return sum(1 for e in json.load(f)["traceEvents"] if e.get("ph") in ("X", "i"))


def test_single_trace_file() -> None:
    ev = load_paths([SMALL])
    assert ev.source == "trace"
    assert ev.traces == [str(SMALL)]
    (trace,) = ev.trace_data
    assert len(trace.events) == raw_count(SMALL)
    assert ev.snapshot_data == []


def test_two_traces_of_one_process_are_parsed_once_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """`audit analyze a.json b.json` of one process's traces: the rank merge parses them to learn
    that they name no two ranks, and load_paths analyses those parsed traces, parsing none again."""
    import auditor.evidence.load as load_module

    parses: list[Path] = []
    parse = load_module.load_trace

    def counting(path, *args, **kwargs):
        parses.append(Path(path))
        return parse(path, *args, **kwargs)

    monkeypatch.setattr(load_module, "load_trace", counting)
    ev = load_paths([SMALL, BERT])
    assert sorted(parses) == sorted([SMALL, BERT])
    assert [t.path for t in ev.trace_data] == [SMALL, BERT]


def test_tensorboard_logdir(tmp_path: Path) -> None:
    run = tmp_path / "tb" / "run1"
    run.mkdir(parents=True)
    (run / "worker0.1700000000.pt.trace.json").write_bytes(gzip.decompress(SMALL.read_bytes()))
    (run / "worker1.1700000001.pt.trace.json.gz").write_bytes(BERT.read_bytes())
    (run / "notes.txt").write_text("not a trace")
    assert [p.name for p in find_traces(tmp_path / "tb")] == ["worker0.1700000000.pt.trace.json",
                                                              "worker1.1700000001.pt.trace.json.gz"]
    ev = load_paths([tmp_path / "tb"])
    assert ev.source == "trace"
    assert [len(t.events) for t in ev.trace_data] == [raw_count(SMALL), raw_count(BERT)]


def test_run_directory_with_its_traces(tmp_path: Path) -> None:
    tb = tmp_path / "tb" / "run"
    tb.mkdir(parents=True)
    (tb / "w.pt.trace.json.gz").write_bytes(SMALL.read_bytes())
    store.save(Evidence(source="run", target="train.py:step", traces=["tb/run/w.pt.trace.json.gz"]), tmp_path)
    ev = load_paths([tmp_path])
    assert ev.source == "run" and ev.target == "train.py:step"
    assert ev.traces == [str((tb / "w.pt.trace.json.gz").resolve())]
    assert len(ev.trace_data) == 1 and len(ev.trace_data[0].events) == raw_count(SMALL)


def test_run_directory_plus_extra_trace_merge(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    store.save(Evidence(source="run", traces=["tb/missing.pt.trace.json"]), run_dir)
    ev = load_paths([run_dir, BERT])
    assert ev.source == "run"
    assert [t.path for t in ev.trace_data] == [BERT]  # the listed-but-missing trace is noted, not fatal
    assert any("missing" in n for n in ev.environment.notes)
    assert str(BERT) in ev.traces


def test_several_traces_merge_without_duplicates() -> None:
    ev = load_paths([SMALL, BERT, SMALL])
    assert [t.path for t in ev.trace_data] == [SMALL, BERT]


def test_snapshot_dispatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The snapshot parser is another module; here a stand-in records what the loader passes it."""
    import auditor.evidence.load as load_module

    seen: list[Path] = []
    monkeypatch.setattr(load_module, "load_snapshot", lambda p: seen.append(Path(p)) or {"parsed": Path(p).name})
    snap = tmp_path / "mem.pickle"
    snap.write_bytes(b"\x80\x04N.")
    ev = load_paths([snap])
    assert ev.source == "snapshot" and ev.snapshots == [str(snap)]
    assert ev.snapshot_data == [{"parsed": "mem.pickle"}] and seen == [snap]
    both = load_paths([snap, SMALL])
    assert both.source == "trace" and len(both.trace_data) == 1 and len(both.snapshot_data) == 1


def test_a_real_snapshot_loads_with_the_figures_its_pickle_holds() -> None:
    """The recorded Llama snapshot through load_paths: its segments, reserved and allocated bytes as
    the pickle holds them (read here with an unpickler that refuses every global)."""
    path = FIXTURES / "snapshots" / "llama_mostly_free_segments.pickle"

    class Refusing(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            raise AssertionError(f"the snapshot names a global: {module}.{name}")

    with open(path, "rb") as f:
        segments = Refusing(f).load()["segments"]
    ev = load_paths([path])
    assert ev.source == "snapshot" and ev.snapshots == [str(path)] and len(ev.snapshot_data) == 1
    snap = ev.snapshot_data[0]
    assert isinstance(snap, Snapshot)
    assert snap.totals.segments == len(segments) == 40
    assert snap.totals.reserved == sum(s["total_size"] for s in segments)
    assert snap.totals.allocated == sum(b["size"] for s in segments for b in s["blocks"]
                                        if b["state"] == "active_allocated")


@pytest.mark.parametrize("name", ["notes.txt", "model.pt", "data.csv"])
def test_unsupported_file(tmp_path: Path, name: str) -> None:
    p = tmp_path / name
    p.write_text("x")
    with pytest.raises(InputError, match="unsupported input"):
        load_paths([p])


def test_missing_and_empty_inputs(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such file"):
        load_paths([tmp_path / "nope.json"])
    with pytest.raises(InputError, match="holds no"):
        load_paths([tmp_path])
    with pytest.raises(InputError):
        load_paths([])


def test_bad_trace_is_an_input_error(tmp_path: Path) -> None:
    p = tmp_path / "broken.pt.trace.json"
    p.write_text('{"traceEvents": [{"ph": "X", "name": "a"')
    with pytest.raises(InputError, match="broken.pt.trace.json"):
        load_paths([p])


V1_RUN = ROOT / "tests" / "data" / "evidence-v1"  # numerics_log_zero's run, saved by version 1


def test_version_1_evidence_reads_its_extra_into_the_fields(tmp_path: Path) -> None:
    """evidence.json version 1 kept collector data in `extra` mappings: they land in the fields of
    the same name; a key with no field is dropped with a load note."""
    import msgspec

    from auditor.evidence.model import EVIDENCE_VERSION, StepRecord, decode
    from auditor.evidence.numerics import NumericsFinal, NumericsStep
    from auditor.evidence.ranks.model import RankIdentity

    doc = msgspec.to_builtins(Evidence(steps=[StepRecord(index=0, start_s=0.0, ms=1.0)]))
    fields = ("numerics", "distributed", "rank", "ranks", "checkpoint")
    doc = {k: v for k, v in doc.items() if k not in fields}
    doc["steps"] = [{k: v for k, v in s.items() if k not in fields} for s in doc["steps"]]
    doc["version"] = 1
    doc["extra"] = {"numerics": {"errors": 2}, "rank": {"rank": 1, "world_size": 2}, "unknown": [1]}
    doc["steps"][0]["extra"] = {"numerics": {"check_in_step_ms": 0.5}}
    ev = decode(json.dumps(doc).encode())
    assert ev.version == EVIDENCE_VERSION
    assert ev.numerics == NumericsFinal(errors=2) and ev.rank == RankIdentity(rank=1, world_size=2)
    assert ev.steps[0].numerics == NumericsStep(check_in_step_ms=0.5) and ev.steps[0].distributed is None
    assert any("'unknown'" in n for n in ev.environment.notes)


def test_version_1_run_directory_gives_the_same_findings(tmp_path: Path) -> None:
    """`audit analyze` of a run directory saved by version 1 finds what that version found."""
    from auditor.cli import main

    with pytest.raises(SystemExit) as e:
        main(["analyze", str(V1_RUN), "--out", str(tmp_path / "out"), "--quiet"])
    assert e.value.code == 0
    ev = store.load_run_dir(V1_RUN)
    assert ev.version == 2 and len(ev.steps) == 12 and all(s.numerics is not None for s in ev.steps)
    found = json.loads((tmp_path / "out" / "findings.json").read_text())["findings"]
    assert [(f["rule"], f["message"].split(" It started")[0]) for f in found] == [
        ("nonfinite", "Step 11 of 12: the loss became nan (gradients and parameters followed).")]


def test_run_directory_whose_trace_was_compressed_since() -> None:
    """The H100 audit of gpu_clean.py, its trace gzipped to share it: evidence.json lists
    tb/.../vm_661...pt.trace.json, the directory holds it as .pt.trace.json.gz; it is read from
    there (it was dropped as missing, and every trace rule skipped)."""
    run = FIXTURES / "h100" / "audited" / "audited_gpu_clean"
    ev = load_paths([run])
    assert [t.label for t in ev.trace_data] == ["vm_661.1795503343090459137.pt.trace.json.gz"]
    assert not any("missing" in n for n in ev.__dict__.get(LOAD_NOTES, []))
