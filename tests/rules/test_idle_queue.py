"""gpu-idle, host-sync and launch-bound reading the launch queue (auditor.evidence.trace.gaps) on the
recorded traces: the expected figures come from the raw JSON through tests/raw_gaps.py, an
independent stdlib reading of the same attribution; the same traces with HIP runtime names (as
ROCm records them) give the same findings; a control stays quiet."""
from __future__ import annotations

import gzip
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from auditor.evidence.model import Evidence
from auditor.evidence.trace.load import load_trace
from auditor.evidence.trace.queries import blocking_calls
from auditor.findings import Finding
from auditor.rules.gpu_idle import GpuIdle
from auditor.rules.host_sync import HostSync
from auditor.rules.launch_bound import LaunchBound
from conftest import FIXTURES
from raw_gaps import fixture_gaps, load_events, per_step, steps

TRACES = FIXTURES / "traces"
RANK0 = TRACES / "a100_rank0_cpu_item_cudagraphs.pt.trace.json.gz"
DDP = TRACES / "a100_ddp_nccl_2rank.pt.trace.json.gz"
BERT = TRACES / "h100_bert_small_item_sync.pt.trace.json.gz"
W4 = TRACES / "v100_resnet50_dataloader_workers4.pt.trace.json.gz"
OWL = TRACES / "h100_owlv2_syncs_dataloader.pt.trace.json.gz"
RULES = (GpuIdle, HostSync, LaunchBound)
events = cache(load_events)  # (each recording's raw events read once per module: the tests only read them)



@cache
def evidence(path: Path) -> Evidence:
    ev = Evidence(source="trace", traces=[str(path)])
    ev.__dict__["trace_data"] = [load_trace(path)]
    return ev


def findings(path: Path, rule_cls: type, **options: Any) -> list[Finding]:
    rule = rule_cls()
    return list(rule.check(evidence(path), rule.options_with(options)))


def base_ms(path: Path) -> float:
    """The recording's time per step: its steps' span over their number (what every share is of)."""
    window = steps(events(path))
    return (window[-1][1] - window[0][0]) / len(window) / 1000


# ---------------------------------------- A100 TorchRec rank 0: the GPU waits on queued work
def test_rank0_no_recoverable_claim_for_idle_on_queued_work() -> None:
    """The five ~64 ms gaps under `## sparse_data_dist ##` had their next GPU op queued by another
    thread's cudaGraphLaunch ~66 ms before the gap began: the GPU waited on a dependency. gpu-idle
    says so and claims only the host's 2.56 ms per step (it claimed all 138.56); host-sync claims
    0.44 ms per step (it claimed 96.38)."""
    causes = per_step(str(RANK0))
    (idle,) = findings(RANK0, GpuIdle)
    e = idle.evidence
    assert e["cause"] == "queued work" and causes["queued work"] > 0.95 * e["idle_ms_per_step"]
    host = sum(causes[c] for c in ("host synchronisation", "data loading", "host work", "launch"))
    assert idle.cost.ms_per_step == pytest.approx(host, abs=1e-3) and idle.cost.ms_per_step < 3
    assert f"For {causes['queued work']:.1f} ms per step the next GPU work was already queued" in idle.message
    assert "the GPU waited on a dependency, not on the host, and that idle is not counted as recoverable" in idle.message
    assert e["queued_by_ms_per_step"]["graph launch"] > 100
    # the five largest gaps: the `## sparse_data_dist ##` range over each, its work queued
    gaps = e["largest_gaps"]
    assert all(g["host"] == "## sparse_data_dist ##" and g["cause"] == "queued work" and g["ms"] > 60 for g in gaps)
    graph = [g for g in gaps if g.get("launch") == "cudaGraphLaunch"]
    assert len(graph) == 4 and all(65 < g["queued_ms_before"] < 67 for g in graph)
    # the raw events: each of those gaps' next op was launched on another thread than the syncing one
    raw, n = fixture_gaps(str(RANK0))
    big = sorted((g for g in raw if g["end"] - g["start"] > 60_000), key=lambda g: g["start"])
    assert len(big) == 5 and all(g["us"]["queued work"] == g["end"] - g["start"] for g in big)
    launched = [g["launch"] for g in big if g["launch"] is not None]
    assert {L["name"] for L in launched} == {"cudaGraphLaunch"}
    syncing = {e["tid"] for e in events(RANK0) if e.get("name") == "cudaStreamSynchronize"}
    assert all(L["tid"] not in syncing for L in launched)
    assert all(120_000 < g["end"] - g["launch"]["ts"] < 135_000 for g in big if g["launch"])  # (~130 ms to run)

    (sync,) = [f for f in findings(RANK0, HostSync) if f.evidence["op"] == "aten::to"]
    assert sync.cost.ms_per_step < 0.5 and sync.evidence["gpu_idle_ms_per_step"] < 1.0
    assert sync.cost.ms_per_step == pytest.approx(sync.evidence["saving_ms_per_step"])
    assert 90 < sync.evidence["queued_idle_ms_per_step"] < 93
    assert "not on these syncs, and that idle is not theirs to recover" in sync.message


# ---------------------------------------- DDP rank 0: launch-starved gaps
def raw_starved(path: Path, max_gap: float = 1000.0) -> tuple[int, float, float]:
    """(gaps, us of idle, us in the launch calls): gaps under max_gap whose next op's launch had not
    returned when the GPU ran out of work, less what data loading and syncs explain."""
    raw, _ = fixture_gaps(str(path))
    pick = [g for g in raw if g["end"] - g["start"] < max_gap and g["us"]["host work"] + g["us"]["launch"] > 0]
    return (len(pick), sum(g["us"]["host work"] + g["us"]["launch"] for g in pick),
            sum(g["us"]["launch"] for g in pick))


def test_ddp_launch_bound_by_the_gaps_cause() -> None:
    """Only 38% of the DDP trace's kernels run shorter than their launch, so the short-kernel test
    stays quiet; but 848 gaps a step, each under 1 ms, end with an op whose launch began after the
    GPU ran out of work: 117.21 ms per step (53% of the 222 ms step) the GPU waited on launches,
    107.41 ms of host work before the launch calls and 9.80 ms in them."""
    n, us, launch_us = raw_starved(DDP)
    steps_ = len(steps(events(DDP)))
    assert steps_ == 3 and n == 2543
    assert us / 1000 / steps_ == pytest.approx(117.206, abs=1e-3)
    quiet = findings(DDP, LaunchBound, **{"min-starved-share": 1.0})
    assert quiet == []  # the short-kernel test alone: quiet
    (f,) = findings(DDP, LaunchBound)
    e = f.evidence
    assert e["short_share"] < 0.5
    assert e["starved_gaps"] == n and e["starved_per_step"] == round(n / steps_, 1)
    assert f.cost.ms_per_step == pytest.approx(us / 1000 / steps_, abs=1e-3) and f.cost.measured
    assert e["starved_launch_ms_per_step"] == pytest.approx(launch_us / 1000 / steps_, abs=1e-3)
    assert f.cost.share_of_step == pytest.approx(us / 1000 / steps_ / base_ms(DDP), abs=1e-4)
    assert f.cost.within == "gpu-idle"
    assert f.message.startswith(f"The GPU waits on the host's kernel launches: capture the step in CUDA graphs. In {DDP.name} the GPU waited on kernel launches 117.2 ms per step (53% of the "
                                "run's time): 848 gaps per step, each under 1 ms")


@pytest.mark.parametrize("path", [RANK0, OWL, BERT])
def test_launch_bound_quiet_where_launches_starve_little(path: Path) -> None:
    """RANK0 and OWLv2: launch-starved gaps are under 1% of the step; BERT: 61 gaps in its step,
    fewer than the 100 a step the rule asks for."""
    n, us, _ = raw_starved(path)
    steps_ = len(steps(events(path)))
    assert n / steps_ < 100 or us / 1000 / steps_ / base_ms(path) < 0.01
    assert findings(path, LaunchBound) == []


def test_control_resnet_with_workers() -> None:
    """ResNet-50 with 4 DataLoader workers: the GPU idles under 30% of the profiled steps, so
    gpu-idle stays quiet; its launch-starved gaps are 13.5% of the step, under min-starved-share,
    so launch-bound reports only what it reported before, its short kernels, with their estimate."""
    assert findings(W4, GpuIdle) == []
    n, us, _ = raw_starved(W4)
    assert 0.1 < us / 1000 / 6 / base_ms(W4) < 0.2
    (f,) = findings(W4, LaunchBound)
    assert "starved_gaps" not in f.evidence and not f.cost.measured
    assert f.message.startswith("The GPU waits on the host's kernel launches: capture the step in CUDA graphs. 942 kernels per step (64% of launched kernels)")


# ---------------------------------------- ROCm/HIP names
def to_hip(src: Path, dst: Path) -> Path:
    """The trace as ROCm's profiler names it: runtime calls cuda* -> hip*, the device an MI300X."""
    with gzip.open(src, "rt") as f:
        doc = json.load(f)
    for e in doc["traceEvents"]:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and str(e.get("name", "")).startswith("cuda"):
            e["name"] = "hip" + e["name"][4:]
    for p in doc.get("deviceProperties", []):
        p["name"] = "AMD Instinct MI300X"
    with gzip.open(dst, "wt", compresslevel=1) as f:  # (json.dumps: the C encoder; json.dump streams in Python)
        f.write(json.dumps(doc))
    return dst


def comparable(f: Finding) -> tuple:
    ev = {k: v for k, v in f.evidence.items() if k != "trace"}
    text = re.sub(r"\bcuda(?=[A-Z])", "hip", json.dumps(ev, sort_keys=True) + f.message)
    return f.rule, f.severity, f.cost.ms_per_step if f.cost else None, re.sub(r"\S+\.pt\.trace\.json\.gz", "T", text)


@pytest.mark.parametrize("path", [RANK0, DDP])
def test_hip_names_give_the_same_findings(path: Path, tmp_path: Path) -> None:
    hip = to_hip(path, tmp_path / path.name)
    names = {e.get("name") for e in load_events(hip) if e.get("cat") == "cuda_runtime"}
    assert not any(n.startswith("cuda") for n in names) and "hipLaunchKernel" in names
    cuda_found = [comparable(f) for r in RULES for f in findings(path, r)]
    hip_found = [comparable(f) for r in RULES for f in findings(hip, r)]
    assert cuda_found and hip_found == cuda_found
    if path == RANK0:
        assert "hipGraphLaunch" in names and "hipStreamSynchronize" in names
        assert any(f[0] == "gpu-idle" and '"graph launch"' in f[3] for f in hip_found)


@pytest.mark.parametrize("call", ["hipMemcpyWithStream", "hipDeviceSynchronize", "hipStreamSynchronize",
                                  "hipEventSynchronize", "hipMemcpy"])
def test_hip_blocking_calls(call: str, tmp_path: Path) -> None:
    events = [{"ph": "X", "cat": "cuda_runtime", "name": call, "pid": 1, "tid": 1, "ts": 10, "dur": 5, "args": {}}]
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": events}))
    trace = load_trace(tmp_path / "t.json")
    assert list(blocking_calls(trace)) == [0]
