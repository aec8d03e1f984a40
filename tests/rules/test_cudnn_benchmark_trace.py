"""cudnn-benchmark on real GPU evidence: `audit run` on a CUDA machine records the program's
`torch.backends.cudnn.benchmark` (environment.backend_flags, read after its setup and at its end)
and a profiler window with shapes; the rule reads the window's cuDNN convolutions beside the flag.

No GPU here: the run is the V100 ResNet-50 recording (real `aten::cudnn_convolution` calls with
their `Input Dims`, 6 ProfilerSteps) given the environment such a run records on a GPU (device
cuda, the flag off, or on for the control). Only the environment is supplied; the convolutions,
shapes, steps, kernel times and the line are the recording's. Expected numbers are recomputed
from the raw JSON. A trace analysed on its own records no flag: the rule is skipped there, and
the skip says what the trace shows."""
from __future__ import annotations

import gzip
import json
from collections import Counter
from functools import cache

import pytest

from conftest import FIXTURES

from auditor.evidence.model import Environment, Evidence
from auditor.evidence.trace.load import load_trace
from auditor.rules.cudnn_benchmark import CudnnBenchmark
from auditor.rules.engine import skip_reason

W0 = FIXTURES / "traces" / "v100_resnet50_dataloader_workers0.pt.trace.json.gz"


@cache
def trace():
    return load_trace(W0)


def gpu_run(benchmark: bool | None, more: dict[str, bool] | None = None) -> Evidence:
    """The recording as the evidence of `audit run` on a GPU, with these backend flags recorded."""
    flags = ({} if benchmark is None else {"cudnn.benchmark": benchmark}) | (more or {})
    ev = Evidence(source="run", traces=[str(W0)],
                  environment=Environment(device="cuda", cuda_available=True, backend_flags=flags))
    ev.__dict__["trace_data"] = [trace()]
    return ev


@cache
def raw() -> tuple[Counter, float, set]:
    """(convolutions per ProfilerStep, their kernels' time in us, their input shapes) from the raw
    events: the cudnn_convolution calls inside each step's range, and the kernels whose launch
    (same correlation) ran inside one of them."""
    with gzip.open(W0, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
    convs = [e for e in events if e["name"] == "aten::cudnn_convolution"]
    per = Counter(s["name"] for c in convs for s in steps
                  if s["tid"] == c["tid"] and s["ts"] <= c["ts"] <= s["ts"] + s["dur"])
    launches = {e["args"]["correlation"]: e for e in events if e.get("cat") == "Runtime"}
    kernel_us = 0.0
    for k in (e for e in events if e.get("cat") == "Kernel"):
        launch = launches.get(k["args"].get("correlation"))
        if launch and any(c["tid"] == launch["tid"] and c["ts"] <= launch["ts"] <= c["ts"] + c["dur"] for c in convs):
            kernel_us += k["dur"]
    return per, kernel_us, {tuple(c["args"]["Input Dims"][0]) for c in convs}


def test_fixed_shape_convolutions_with_the_flag_off_on_a_gpu_run() -> None:
    rule = CudnnBenchmark()
    ev = gpu_run(False)
    assert skip_reason(rule, ev) is None
    found = list(rule.check(ev, rule.default_options()))
    assert len(found) == 1
    f = found[0]
    per, kernel_us, inputs = raw()
    assert set(per.values()) == {53} and len(per) == 6  # ResNet-50's 53 convolutions in each of 6 steps
    e = f.evidence
    assert e["convolutions_per_step"] == 53.0 and e["steps"] == 6 and e["steps_with_convs"] == 6
    assert e["steps_with_common_shapes"] == 6 and e["benchmark"] is False
    assert {tuple(s) for s in e["input_shapes"]} == inputs and len(inputs) == 12
    assert e["kernel_ms_per_step"] == round(kernel_us / 1000 / 6, 3)
    assert [(loc.file, loc.line) for loc in f.locations] == [("resnet50_profiler_api.py", 46)]  # the model's call
    assert "53 cuDNN convolutions per step" in f.message and "6 of 6 profiled steps" in f.message
    # its predicted saving: 20% of the convolutions' kernel time, an estimate of device time
    assert f.cost.ms_per_step == pytest.approx(0.2 * kernel_us / 1000 / 6, abs=1e-3) and f.cost.measured is False
    assert f.fix.config == {"torch.backends.cudnn.benchmark": True}


@pytest.mark.parametrize("flag", [True, None], ids=["flag-on", "flag-not-recorded"])
def test_silent_when_the_flag_is_on_or_unknown(flag) -> None:
    rule = CudnnBenchmark()
    ev = gpu_run(flag)
    if flag is None:
        assert skip_reason(rule, ev) is not None
    else:
        assert skip_reason(rule, ev) is None and list(rule.check(ev, rule.default_options())) == []


def test_silent_when_the_program_asked_for_determinism() -> None:
    rule = CudnnBenchmark()
    for ev in (gpu_run(False, {"cudnn.deterministic": True}), gpu_run(False, {"deterministic_algorithms": True})):
        assert skip_reason(rule, ev) is None and list(rule.check(ev, rule.default_options())) == []


def test_a_trace_on_its_own_is_skipped_saying_what_it_shows() -> None:
    ev = Evidence(source="trace", traces=[str(W0)])
    ev.__dict__["trace_data"] = [trace()]
    reason = skip_reason(CudnnBenchmark(), ev)
    assert reason.startswith("a profiler trace does not record torch.backends.cudnn.benchmark")
    assert "53 cuDNN convolutions per step, with the same 12 input shape(s) in 6 of 6 steps" in reason


def test_a_run_records_what_the_gpu_halves_read(example_audit) -> None:
    """What the three GPU halves read comes from the run itself, with no observer of its own: the
    flag in the environment and a profiler window recorded with shapes and Python stacks (on a GPU
    the same window adds CUDA activity). Shown on the session's CPU audit of examples/clean.py,
    where the rules run on that window and find nothing."""
    from auditor.evidence.load import load_paths
    from auditor.evidence.trace.efficiency import op_shapes

    a = example_audit("clean")
    assert a.returncode == 0, a.stderr[-2000:]
    ev = load_paths([a.out])
    assert ev.environment.backend_flags["cudnn.benchmark"] is False
    assert ev.trace_data and op_shapes(ev.trace_data[0]) and ev.trace_data[0].has_stacks
    skipped = {s["rule"] for s in json.loads((a.out / "findings.json").read_text())["skipped_rules"]}
    assert not skipped & {"cudnn-benchmark", "manual-update", "blocking-pinned-copy"}
