"""A TensorBoard logdir holding two runs whose traces share a file name (`run-a/host.pt.trace.json.gz`,
`run-b/host.pt.trace.json.gz`): every message about a trace names its run, so the user can tell
which run it is about, while the evidence keeps the trace's real path.

The logdirs are made in tmp_path from the recorded fixtures, copied byte for byte (the per-rank case
only rewrites the copy's `distributedInfo.rank`, so the two runs are two ranks).
"""
from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from conftest import FIXTURES, audit

from auditor.evidence.load import load_paths

TRACES = FIXTURES / "traces"
RESNET = TRACES / "v100_resnet50_dataloader_workers0.pt.trace.json.gz"
BERT = TRACES / "h100_bert_small_item_sync.pt.trace.json.gz"
DDP = TRACES / "a100_ddp_nccl_2rank.pt.trace.json.gz"
NAME = "host.pt.trace.json.gz"



def two_runs(root: Path, a: Path, b: Path) -> Path:
    logdir = root / "tb"
    for run, src in (("run-a", a), ("run-b", b)):
        (logdir / run).mkdir(parents=True)
        shutil.copyfile(src, logdir / run / NAME)
    return logdir


def test_loaded_traces_are_named_by_their_run(tmp_path: Path) -> None:
    logdir = two_runs(tmp_path, RESNET, BERT)
    ev = load_paths([logdir])
    assert [t.label for t in ev.trace_data] == [f"run-a/{NAME}", f"run-b/{NAME}"]
    # the path is the file's real path
    assert [str(t.path) for t in ev.trace_data] == ev.traces == [str(logdir / r / NAME) for r in ("run-a", "run-b")]
    assert ev.environment.notes == [f"device as recorded in run-a/{NAME}: Tesla V100-DGXS-32GB"]
    # a trace given as a file is named as it is
    assert [t.label for t in load_paths([logdir / "run-b" / NAME]).trace_data] == [NAME]


def test_analyze_findings_name_the_run(tmp_path: Path) -> None:
    logdir = two_runs(tmp_path, RESNET, BERT)
    a = audit("analyze", str(logdir), out=tmp_path / "out", cwd=tmp_path)
    assert a.returncode == 0, a.stderr
    about_traces = [f for f in a.findings if "trace" in f["evidence"]]
    runs = {Path(f["evidence"]["trace"]).parent.name for f in about_traces}
    assert runs == {"run-a", "run-b"}  # both runs have findings (gpu-idle fires for each)
    assert len({f["message"] for f in a.rule("gpu-idle")}) == 2
    for f in about_traces:
        run = Path(f["evidence"]["trace"]).parent.name
        assert f"{run}/{NAME}" in f["message"], f["message"]
        assert Path(f["evidence"]["trace"]).is_file()
    assert f"device as recorded in run-a/{NAME}: Tesla V100-DGXS-32GB" in a.findings_doc["environment"]["notes"]
    assert f"run-a/{NAME}" in a.stdout and f"run-b/{NAME}" in a.stdout


def test_two_runs_that_are_two_ranks_keep_their_run_names(tmp_path: Path) -> None:
    """The per-rank merge reads the logdir's traces itself; the trace rules then read rank 0's."""
    logdir = two_runs(tmp_path, DDP, DDP)
    with gzip.open(DDP, "rt") as f:
        doc = json.load(f)
    assert doc["distributedInfo"]["rank"] == 0
    doc["distributedInfo"]["rank"] = 1
    with gzip.open(logdir / "run-b" / NAME, "wt") as f:
        json.dump(doc, f)

    ev = load_paths([logdir])
    assert any(n.startswith("Merged profiler traces of 2 rank(s)") for n in ev.environment.notes)
    assert [t.label for t in ev.trace_data] == [f"run-a/{NAME}"]
    assert str(ev.trace_data[0].path) == str(logdir / "run-a" / NAME)
