"""blocking-pinned-copy on GPU traces (`audit analyze`, and the profiler window of `audit run` on a
CUDA machine): a pinned host-to-device copy whose operator synchronised the stream after it.

The H100 recording of examples/gpu_blocking_pinned_copy.py holds the real case (the last test). The
A100 TorchRec trace holds 35 pinned host-to-device copies made with non_blocking=True (no sync in
their `aten::copy_`): the control.
The positive case is derived from the V100 ResNet-50 recording, whose 12 input/label copies were
made without non_blocking (each `aten::copy_` launches `cudaMemcpyAsync` then calls
`cudaStreamSynchronize`) from pageable memory: the test renames their copy records from
`Memcpy HtoD (Pageable -> Device)` to `Memcpy HtoD (Pinned -> Device)` and changes nothing else.
That is the record such a copy makes from pinned memory: torch's CUDA copy
(aten/src/ATen/native/cuda/Copy.cu) runs `memcpy_and_sync` (cudaMemcpyAsync + cudaStreamSynchronize)
for non_blocking=False whatever the host memory, and CUPTI names the record by the host memory's
kind. Its timings stay the pageable recording's (a pageable cudaMemcpyAsync itself waits for the
staging, so the sync after it is short). Expected numbers are recomputed from the raw JSON."""
from __future__ import annotations

import gzip
import json
from functools import cache
from pathlib import Path

import pytest

from conftest import EXAMPLES, FIXTURES

from auditor.evidence.model import Evidence
from auditor.evidence.trace.load import load_trace
from auditor.rules.blocking_pinned_copy import BlockingPinnedCopy, blocking_pinned_copies
from auditor.rules.engine import skip_reason

TRACES = FIXTURES / "traces"
W0 = TRACES / "v100_resnet50_dataloader_workers0.pt.trace.json.gz"
RANK0 = TRACES / "a100_rank0_cpu_item_cudagraphs.pt.trace.json.gz"
PAGEABLE, PINNED = b'"Memcpy HtoD (Pageable -> Device)"', b'"Memcpy HtoD (Pinned -> Device)"'


@pytest.fixture(scope="module")
def pinned_w0(tmp_path_factory) -> Path:
    """The V100 recording with its host-to-device copy records renamed as pinned (see above)."""
    raw = gzip.decompress(W0.read_bytes())
    assert raw.count(PAGEABLE) == 12 and raw.count(PINNED) == 0
    out = tmp_path_factory.mktemp("derived") / "v100_resnet50_pinned_blocking.pt.trace.json.gz"
    out.write_bytes(gzip.compress(raw.replace(PAGEABLE, PINNED), 1))
    return out


def judged(path: Path) -> list:
    ev = Evidence(source="trace", traces=[str(path)])
    ev.__dict__["trace_data"] = [load_trace(path)]
    rule = BlockingPinnedCopy()
    assert skip_reason(rule, ev) is None
    return list(rule.check(ev, rule.default_options()))


@cache
def raw_expected(path: Path) -> tuple[int, int, float]:
    """(copies, bytes, host wait in us) of the pinned HtoD copies followed by a stream sync on their
    launching thread, from the raw events: each copy's `cudaMemcpyAsync` (same correlation) and
    the first `cudaStreamSynchronize` on its thread after it."""
    with gzip.open(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    copies = [e for e in events if "HtoD" in e["name"] and "Pinned" in e["name"]]
    launches = {e["args"]["correlation"]: e for e in events if e["name"] == "cudaMemcpyAsync"}
    syncs = sorted((e for e in events if e["name"] == "cudaStreamSynchronize"), key=lambda e: e["ts"])
    n = nbytes = 0
    wait = 0.0
    for c in copies:
        launch = launches[c["args"]["correlation"]]
        after = [s for s in syncs if s["tid"] == launch["tid"] and s["ts"] >= launch["ts"] + launch["dur"]]
        if after:
            n, nbytes, wait = n + 1, nbytes + c["args"]["bytes"], wait + after[0]["dur"]
    return n, nbytes, wait


def test_blocking_pinned_copies_in_a_recording(pinned_w0: Path) -> None:
    found = judged(pinned_w0)
    assert len(found) == 1
    f = found[0]
    copies, nbytes, wait_us = raw_expected(pinned_w0)
    assert copies == 12 and nbytes == 6 * (19267584 + 256)  # the 32x3x224x224 fp32 batch and its labels, 6 steps
    ev = f.evidence
    assert ev["copies"] == 12 and ev["copies_per_step"] == 2.0 and ev["steps"] == 6 and ev["steps_with_copies"] == 6
    assert ev["bytes_per_step"] == round(nbytes / 6) and ev["ops"] == {"aten::to": 12}
    assert ev["wait_ms_per_step"] == round(wait_us / 1000 / 6, 3) == f.cost.ms_per_step and f.cost.measured
    # the line of the recorded program that copies the batch (its old-schema `Call stack`)
    assert [(loc.file, loc.line) for loc in f.locations] == [("resnet50_profiler_api.py", 44)]
    assert "2 host-to-device copies per step from pinned memory (19.27 MB per step)" in f.message
    assert f.fix.config == {"non_blocking": True} and f.fix.edits == []  # (the program's file is not here)


@pytest.mark.parametrize("path", [W0, RANK0], ids=["pageable-blocking", "pinned-non-blocking"])
def test_silent_on_the_recordings_themselves(path: Path) -> None:
    """The V100 copies are pageable (pageable-copy's); the A100's 35 pinned copies were made with
    non_blocking=True: their `aten::copy_` launches the copy and returns, no sync in it."""
    trace = load_trace(path)
    if path == RANK0:
        pinned = trace.matching(r"HtoD.*Pinned", trace.of("memcpy"))
        assert len(pinned) == 35
    assert blocking_pinned_copies(trace) == []
    assert judged(path) == []


H100_PINNED = FIXTURES / "h100" / "plain" / "plain_gpu_blocking_pinned_copy.json.gz"
EXAMPLE = EXAMPLES / "gpu_blocking_pinned_copy.py"


def raw_blocking_in_operator(path: Path) -> tuple[int, int, int, float]:
    """(pinned HtoD copies, those whose operator synchronised the stream after launching them, their
    bytes, the host's wait in those syncs in us), from the raw events: a copy's `cudaMemcpyAsync`
    (same correlation) and a `cudaStreamSynchronize` on its thread that starts after the launch and
    inside the innermost `aten::copy_` around it."""
    with gzip.open(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    copies = [e for e in events if "HtoD" in e["name"] and "Pinned" in e["name"]]
    launches = {e["args"]["correlation"]: e for e in events if e["name"] == "cudaMemcpyAsync"}
    syncs = [e for e in events if e["name"] == "cudaStreamSynchronize"]
    ops = [e for e in events if e["name"] == "aten::copy_"]
    n = nbytes = 0
    wait = 0.0
    for c in copies:
        launch = launches[c["args"]["correlation"]]
        op = min((o for o in ops if o["tid"] == launch["tid"] and o["ts"] <= launch["ts"]
                  and launch["ts"] + launch["dur"] <= o["ts"] + o["dur"]), key=lambda o: o["dur"])
        inside = [s for s in syncs if s["tid"] == launch["tid"] and launch["ts"] + launch["dur"] <= s["ts"]
                  and s["ts"] + s["dur"] <= op["ts"] + op["dur"]]
        if inside:
            n, nbytes, wait = n + 1, nbytes + c["args"]["bytes"], wait + inside[0]["dur"]
    return len(copies), n, nbytes, wait


def test_the_h100_recording_of_a_blocking_pinned_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/gpu_blocking_pinned_copy.py on the H100, plain (steps 6-8): each step copies its
    pinned batch with `x.to(device)` (line 34, blocking) and its labels with
    `y.to(device, non_blocking=True)` (line 35). Of the 6 pinned copies the 3 of the batch synchronised
    the stream: the finding counts those, with the recorded bytes and wait; the labels' are not
    counted. The trace names the step by its def line (32) and two lines of its body call `to`, so
    the finding names both (auditor.evidence.trace.call_lines: candidates, never a precise wrong line)."""
    monkeypatch.chdir(EXAMPLES)  # the recording names the example by its file name
    pinned, copies, nbytes, wait_us = raw_blocking_in_operator(H100_PINNED)
    assert (pinned, copies, nbytes) == (6, 3, 3 * 512 * 1024 * 4)  # 3 steps' fp32 512x1024 batches
    (f,) = judged(H100_PINNED)
    ev = f.evidence
    assert (ev["copies"], ev["copies_per_step"], ev["steps"], ev["steps_with_copies"]) == (3, 1.0, 3, 3)
    assert ev["bytes"] == nbytes and ev["bytes_per_step"] == nbytes // 3 and ev["ops"] == {"aten::to": 3}
    assert ev["wait_ms_per_step"] == round(wait_us / 1000 / 3, 3) == f.cost.ms_per_step and f.cost.measured
    (loc,) = f.locations
    # (both lines that call `to` are named, the first as the line, no source quoted as if it were the one)
    assert (loc.file, loc.line, loc.code) == ("gpu_blocking_pinned_copy.py", 34, "")
    assert "one of lines 34, 35" in loc.note, loc.note
    step_body = enumerate(EXAMPLE.read_text().splitlines()[32:], 33)
    assert [n for n, text in step_body if ".to(device" in text] == [34, 35]
    assert "1 host-to-device copies per step from pinned memory (2.10 MB per step)" in f.message
