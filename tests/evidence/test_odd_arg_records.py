"""Operators' argument records a model or rule cannot use (a stride of 0, negative or huge dims,
missing inputs, values of the wrong type): each reader skips the operator and counts it, and
`audit analyze` still writes findings.json and report.html, whatever one model or rule raises."""
from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from conftest import audit

from auditor.evidence.load import load_paths
from auditor.evidence.trace import efficiency as eff_module
from auditor.evidence.trace.arg_records import raw_keys, record
from auditor.evidence.trace.efficiency import efficiency, op_shapes, op_work
from auditor.evidence.trace.load import load_trace
from auditor.reports import write_reports
from auditor.rules.cudnn_benchmark import CudnnBenchmark
from auditor.rules.engine import run_rules

H100 = {"id": 0, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85520809984, "computeMajor": 9,
        "computeMinor": 0, "numSms": 132}
GOOD_CONV = {"Input Dims": [[8, 3, 32, 32], [16, 3, 3, 3], [16], [], [], [], [], [], []],
             "Input type": ["float", "float", "float", "ScalarList", "ScalarList", "ScalarList", "Scalar",
                            "ScalarList", "Scalar"],
             "Concrete Inputs": ["", "", "", "[1, 1]", "[1, 1]", "[1, 1]", "False", "[0, 0]", "1"]}
# the odd records, each on one convolution that ran a kernel
ODD = {
    "zero stride": {**GOOD_CONV, "Concrete Inputs": ["", "", "", "[0, 0]", "[1, 1]", "[1, 1]", "False", "[0, 0]", "1"]},
    "negative stride": {**GOOD_CONV, "Concrete Inputs": ["", "", "", "[-2, 1]", "[1, 1]", "[1, 1]", "False", "", "1"]},
    "negative dims": {**GOOD_CONV, "Input Dims": [[8, -3, 32, 32], [16, 3, 3, 3], [16]]},
    "missing dims": {"Input type": ["float", "float"]},
    "dims not a list": {**GOOD_CONV, "Input Dims": "8x3x32x32"},
    "huge dims": {**GOOD_CONV, "Input Dims": [[10 ** 30, 3, 32, 32], [16, 3, 3, 3], [16]]},
    "huge stride": {**GOOD_CONV, "Concrete Inputs": ["", "", "", f"[{10 ** 30}, 1]", "", "", "", "", ""]},
    "empty input list": {**GOOD_CONV, "Input Dims": []},
}
# readable dims with types and concrete inputs of the wrong type: read as float32 with the input's size
WRONG_TYPES = {**GOOD_CONV, "Input type": {"a": 1}, "Concrete Inputs": 7}
GOOD_FLOPS = 2.0 * 8 * 16 * 32 * 32 * 27


def write_conv_trace(path: Path, records: list[dict]) -> Path:
    """One ProfilerStep of cuDNN convolutions, one a record, each launching one 100 us kernel."""
    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0.0,
               "dur": 200.0 * len(records) + 100, "args": {}}]
    for i, args in enumerate(records):
        t = 10.0 + 200.0 * i
        events += [
            {"ph": "X", "cat": "cpu_op", "name": "aten::cudnn_convolution", "pid": 1, "tid": 1, "ts": t, "dur": 30.0,
             "args": {"External id": i + 1, **args}},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": t + 10, "dur": 5.0,
             "args": {"External id": i + 1, "correlation": 100 + i}},
            {"ph": "X", "cat": "kernel", "name": "sm90_xmma_fprop_implicit_gemm_f32f32", "pid": 0, "tid": 7,
             "ts": t + 40, "dur": 100.0, "args": {"External id": i + 1, "correlation": 100 + i, "device": 0,
                                                  "stream": 7}},
        ]
    path.write_text(json.dumps({"schemaVersion": 1, "deviceProperties": [H100], "traceEvents": events}))
    return path


@pytest.mark.parametrize("what", sorted(ODD))
def test_op_work_skips_an_odd_record(what):
    """The model's formula on the record as the parse reads it, and on the raw lists: no number, no
    exception (a stride of 0 raised ZeroDivisionError and cost a real MI300X trace its reports)."""
    args = ODD[what]
    assert op_work("aten::cudnn_convolution", args.get("Input Dims"), args.get("Input type"),
                   args.get("Concrete Inputs")) is None
    keyed = raw_keys([msgspec.Raw(json.dumps(args).encode())])[0]
    rec = record(keyed)  # (the parse's reading of it: odd numbers are no shape)
    assert all(d is None or all(0 <= x <= 1 << 48 for x in d) for d in rec.dims)


def test_op_work_reads_dims_beside_types_of_the_wrong_type():
    assert op_work("aten::cudnn_convolution", WRONG_TYPES["Input Dims"], WRONG_TYPES["Input type"],
                   WRONG_TYPES["Concrete Inputs"])[0] == GOOD_FLOPS


def test_odd_records_are_skipped_and_counted(tmp_path):
    trace = load_trace(write_conv_trace(tmp_path / "odd.pt.trace.json", [GOOD_CONV, *ODD.values()]))
    eff = efficiency(trace)
    assert not eff.failed
    (good,) = eff.ops  # the one readable convolution: 2 * 8*16*32*32 * 3*3*3 FLOPs
    assert good.count == 1 and good.flops == GOOD_FLOPS
    shaped = op_shapes(trace)
    # every odd record that still names inputs reaches the model, which leaves it out and counts it
    assert eff.unread_ops == len(shaped) - 1 >= 5


def test_analyze_writes_every_report_whatever_the_records(tmp_path):
    path = write_conv_trace(tmp_path / "odd.pt.trace.json", [GOOD_CONV, WRONG_TYPES, *ODD.values()] * 2)
    a = audit("analyze", str(path), "--quiet", out=tmp_path / "out")
    assert a.returncode in (0, 1), a.stderr
    assert "could not write" not in a.stderr and "Traceback" not in a.stderr, a.stderr
    doc = json.loads((tmp_path / "out" / "findings.json").read_text())
    assert (tmp_path / "out" / "report.html").stat().st_size > 0
    assert not doc.get("errors"), doc.get("errors")


def test_a_raising_model_or_rule_costs_only_itself(tmp_path, monkeypatch):
    """A model that raises leaves findings.json's `steps.gpu` empty and the reports written; a rule
    whose skip_reason raises is reported skipped with the error as its reason."""
    path = write_conv_trace(tmp_path / "conv.pt.trace.json", [GOOD_CONV] * 3)
    ev = load_paths([path])

    def broken(*_a, **_k):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(eff_module, "_efficiency", broken)
    monkeypatch.setattr(CudnnBenchmark, "skip_reason", broken)
    results = run_rules(ev)
    (skip,) = [s for s in results.skipped if s["rule"] == "cudnn-benchmark"]
    assert skip["reason"] == "could not be judged: ZeroDivisionError: division by zero"
    written = write_reports(tmp_path / "out", ev, results)
    assert {"findings.json", "report.html"} <= {p.name for p in written.values()}
    doc = json.loads((tmp_path / "out" / "findings.json").read_text())
    assert doc["steps"]["gpu"] is None
    assert efficiency(ev.trace_data[0]).failed == "ZeroDivisionError: division by zero"
