"""The trace rules on recorded GPU traces. Every expected number is recomputed here from the raw
JSON with the standard library (json + gzip), never through the parser; controls must stay quiet."""
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
from auditor.rules.amp_opportunity import AmpOpportunity
from auditor.rules.base import Rule
from auditor.rules.engine import skip_reason
from auditor.findings import Finding
from auditor.rules._support.text import per_step
from auditor.rules.dataloader_on_device import DataloaderOnDevice
from auditor.rules.gpu_idle import GpuIdle
from auditor.rules.launch_bound import LaunchBound
from auditor.rules.pageable_copy import PageableCopy
from auditor.rules.dataloader_bound import DataloaderBound
from auditor.rules.host_sync import HostSync

from conftest import FIXTURES
from raw_gaps import CAUSES, per_step as raw_causes, raw_gaps, sync_costs

TRACES = FIXTURES / "traces"
OWL = "h100_owlv2_syncs_dataloader.pt.trace.json.gz"
BERT = "h100_bert_small_item_sync.pt.trace.json.gz"
W0 = "v100_resnet50_dataloader_workers0.pt.trace.json.gz"
W4 = "v100_resnet50_dataloader_workers4.pt.trace.json.gz"
RANK0 = "a100_rank0_cpu_item_cudagraphs.pt.trace.json.gz"
SMALL = "a100_item_sync_small.pt.trace.json.gz"
DDP = "a100_ddp_nccl_2rank.pt.trace.json.gz"
GPU_CATS = ("kernel", "Kernel", "gpu_memcpy", "Memcpy", "gpu_memset", "Memset")
STANDALONE = (PageableCopy, GpuIdle, LaunchBound, DataloaderOnDevice, AmpOpportunity)


@cache
def raw(name: str) -> list[dict]:
    with gzip.open(TRACES / name, "rt") as f:
        return json.load(f)["traceEvents"]


@cache
def evidence(name: str) -> Evidence:
    ev = Evidence(source="trace", traces=[str(TRACES / name)])
    ev.__dict__["trace_data"] = [load_trace(TRACES / name)]
    return ev


def run(rule_cls: type[Rule], name: str, **options: Any) -> list[Finding]:
    rule = rule_cls()
    assert skip_reason(rule, evidence(name)) is None
    return list(rule.check(evidence(name), rule.options_with(options)))


@cache
def raw_steps(name: str) -> list[tuple[float, float]]:
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in raw(name) if e.get("ph") == "X"
                  and str(e.get("name", "")).startswith("ProfilerStep#")
                  and e.get("cat") in ("user_annotation", "Operator"))


# ---------------------------------------- general
@pytest.mark.parametrize("rule_cls", STANDALONE)
def test_rules_document_themselves_and_skip_without_a_trace(rule_cls: type[Rule]) -> None:
    docs = rule_cls.docs()
    for heading in ("What it detects", "Why it costs", "Example", "Fix", "Evidence needed"):
        assert heading in docs
    assert re.fullmatch(r"[a-z]+(-[a-z]+)*", rule_cls.id)
    assert skip_reason(rule_cls(), Evidence()) is not None


def test_ids_are_the_contract() -> None:
    assert [r.id for r in STANDALONE] == ["pageable-copy", "gpu-idle", "launch-bound", "dataloader-on-device",
                                          "amp-opportunity"]


# ---------------------------------------- pageable-copy
@pytest.mark.parametrize("name", [OWL, W0])
def test_pageable_copy_counts_bytes_and_time(name: str) -> None:
    findings = {f.evidence["direction"]: f for f in run(PageableCopy, name)}
    steps = len(raw_steps(name))
    for direction in ("HtoD", "DtoH"):
        copies = [e for e in raw(name) if e.get("cat") in ("gpu_memcpy", "Memcpy") and "Pageable" in e["name"]
                  and direction in e["name"]]
        total = sum(e["args"]["bytes"] for e in copies)
        if total / steps < 1e6:
            assert direction not in findings
            continue
        f = findings[direction]
        assert f.evidence["copies"] == len(copies)
        assert f.evidence["bytes"] == total
        assert f.cost.ms_per_step == pytest.approx(sum(e["dur"] for e in copies) / 1000 / steps, abs=1e-3)
        assert f.fix.config == {"pin_memory": True, "non_blocking": True}
    assert set(findings) == ({"HtoD", "DtoH"} if name == OWL else {"HtoD"})


def test_pageable_copy_points_at_the_copy_line() -> None:
    (f,) = run(PageableCopy, W0)
    assert (f.locations[0].file, f.locations[0].line) == ("resnet50_profiler_api.py", 44)
    assert f.evidence["copies"] == 12 and f.evidence["bytes"] == 115_607_040


@pytest.mark.parametrize("name", [RANK0, SMALL, BERT, DDP])
def test_pageable_copy_quiet_on_small_or_pinned_copies(name: str) -> None:
    pageable = sum(e["args"]["bytes"] for e in raw(name) if e.get("cat") == "gpu_memcpy" and "Pageable" in e["name"])
    assert pageable / max(1, len(raw_steps(name))) < 1e6  # the control really is below the threshold
    assert run(PageableCopy, name) == []


# ---------------------------------------- gpu-idle
def raw_idle_share(name: str) -> float:
    steps = raw_steps(name)
    lo, hi = steps[0][0], steps[-1][1]
    spans = sorted((max(e["ts"], lo), min(e["ts"] + e["dur"], hi)) for e in raw(name)
                   if e.get("ph") == "X" and e.get("cat") in GPU_CATS)
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    return 1 - busy / (hi - lo)


# RANK0: the GPU idles 64% of the step, 98% of that with its next work already queued (graph
# launches ~66 ms before each of the five ~64 ms gaps): a dependency, not the host. Until the gap
# attribution the cause was "host synchronisation" (the idle overlapped six copies to pageable
# memory a step) and the cost all idle, 138.56 ms per step; it is now the host's share, 2.56 ms.
@pytest.mark.parametrize("name,cause", [(OWL, "data loading"), (W0, "data loading"), (RANK0, "queued work")])
def test_gpu_idle_share_and_cause(name: str, cause: str) -> None:
    (f,) = run(GpuIdle, name)
    want = raw_idle_share(name)
    assert want >= 0.3
    assert f.evidence["idle_share"] == pytest.approx(want, abs=1e-3)  # (of the profiled window: the threshold's)
    steps = raw_steps(name)
    per_step = want * (steps[-1][1] - steps[0][0]) / len(steps) / 1000
    assert f.evidence["idle_ms_per_step"] == pytest.approx(per_step, abs=1e-2)
    # the cost is the idle the host caused (queued work and untraced idle left out), its share of
    # the run's time per step (the ProfilerSteps' span over their number), what the report states
    causes = raw_causes(str(TRACES / name))
    claim = sum(causes[c] for c in ("host synchronisation", "data loading", "host work", "launch"))
    base = (steps[-1][1] - steps[0][0]) / len(steps) / 1000
    assert f.cost.ms_per_step == pytest.approx(claim, abs=1e-2)
    assert f.cost.ms_per_step == pytest.approx(per_step - causes["queued work"] - causes["untraced"], abs=1e-2)
    assert f.cost.share_of_step == pytest.approx(claim / base, abs=1e-3)
    assert f.cost.share_of_step == round(f.cost.ms_per_step / round(base, 3), 4)
    assert f.evidence["idle_by_cause_ms_per_step"] == pytest.approx(causes, abs=1e-3)
    assert f.evidence["cause"] == cause == max(causes, key=causes.get)
    gaps = f.evidence["largest_gaps"]
    assert len(gaps) == 5 and gaps == sorted(gaps, key=lambda g: -g["ms"])


def test_gpu_idle_owlv2_gaps_are_the_dataloader() -> None:
    (f,) = run(GpuIdle, OWL)
    assert f.evidence["largest_gaps"][0]["ms"] > 100
    assert all("DataLoader" in g["host"] for g in f.evidence["largest_gaps"])


def test_gpu_idle_quiet_when_gpu_is_busy_enough() -> None:
    assert raw_idle_share(W4) < 0.3
    assert run(GpuIdle, W4) == []
    assert len(run(GpuIdle, W4, **{"min-idle-share": 0.2})) == 1  # the threshold is what keeps it quiet


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


RAW_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def raw_idle(events: list[dict]) -> tuple[float, float, list[tuple[float, float]]]:
    """(window, idle us inside the ProfilerSteps, idle intervals) from raw events."""
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X"
             and str(e.get("name", "")).startswith("ProfilerStep#") and e.get("cat") == "user_annotation"]
    lo, hi = min(a for a, _ in steps), max(b for _, b in steps)
    busy = _merge([(max(e["ts"], lo), min(e["ts"] + e["dur"], hi)) for e in events
                   if e.get("ph") == "X" and e.get("cat") in GPU_CATS])
    idle, cur = [], lo
    for a, b in busy:
        if a > cur:
            idle.append((cur, a))
        cur = max(cur, b)
    if cur < hi:
        idle.append((cur, hi))
    return hi - lo, sum(b - a for a, b in idle), idle


def raw_blocking(events: list[dict]) -> list[dict]:
    """The runtime calls in which the host waits for the GPU, from the raw events: the sync calls,
    and cudaMemcpyAsync calls whose copy (same correlation) is device-to-pageable: those return
    only once the copy is done."""
    to_pageable = {e["args"]["correlation"] for e in events if e.get("cat") == "gpu_memcpy"
                   and re.search(r"DtoH.*Pageable", e.get("name", ""))}
    return [e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"
            and (e.get("name") in RAW_SYNCS
                 or (e.get("name") == "cudaMemcpyAsync" and e.get("args", {}).get("correlation") in to_pageable))]


def raw_sync_spans(events: list[dict]) -> list[tuple[float, float]]:
    return _merge([(e["ts"], e["ts"] + e["dur"]) for e in raw_blocking(events)])


def item_waits_trace(tmp_path: Path, untraced_wait: bool) -> list[dict]:
    """One 10 ms ProfilerStep: a matmul kernel, then `.item()` at train.py:47 (aten::item ->
    _local_scalar_dense -> cudaMemcpyAsync + cudaStreamSynchronize, as the A100 fixture records it),
    then an add kernel. untraced_wait: the 4-byte copy the sync waits for starts only at 7.15 ms and
    no work of this process runs before it (the device busy with work the trace does not show,
    e.g. another process's): the GPU is idle for most of the sync. Otherwise the matmul runs until
    the copy: the sync waits on traced work, and the idle time comes after it."""
    def x(cat: str, name: str, ts: int, dur: int, pid: int = 1, tid: int = 1, **args: Any) -> dict:
        return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}

    events = [
        x("user_annotation", "ProfilerStep#1", 0, 10_000),
        x("cpu_op", "aten::mm", 100, 300), x("cuda_runtime", "cudaLaunchKernel", 200, 100, correlation=1),
        x("kernel", "ampere_sgemm_128x64_nn", 500, 1500 if untraced_wait else 6650, pid=0, tid=7, correlation=1),
        x("python_function", "train.py(47): step", 2050, 5300),
        x("cpu_op", "aten::item", 2100, 5200), x("cpu_op", "aten::_local_scalar_dense", 2150, 5100),
        x("cuda_runtime", "cudaMemcpyAsync", 2160, 30, correlation=2),
        x("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 7150, 2, pid=0, tid=7, correlation=2, bytes=4),
        x("cuda_runtime", "cudaStreamSynchronize", 2200, 5000, correlation=3),
        x("cuda_sync", "Stream Sync", 2201, 4998, pid=0, tid=7, correlation=3),
        x("cpu_op", "aten::add", 7400, 200), x("cuda_runtime", "cudaLaunchKernel", 7450, 40, correlation=4),
        x("kernel", "vectorized_elementwise_kernel", 7500, 1500, pid=0, tid=7, correlation=4),
    ]
    (tmp_path / "item.json").write_text(json.dumps({"traceEvents": events}))
    return events


@pytest.mark.parametrize("untraced_wait", [True, False])
def test_gpu_idle_charges_a_sync_only_the_idle_it_causes(tmp_path: Path, untraced_wait: bool) -> None:
    """The `.item()` trace: the sync is charged the idle from its return until the host's next
    launch (7,152-7,450 us: 298 us) either way. untraced_wait: for 4.9 ms inside the sync the GPU
    had the 4-byte copy queued (launched at 2,160 us, run at 7,150 us): it waited on work the trace
    does not show, not on the host, and that is the main cause (until the gap attribution all of it
    was "host synchronisation", charged to the sync). Otherwise the kernel runs until the copy, and
    the sync's 298 us are its only idle inside the step's work."""
    events = item_waits_trace(tmp_path, untraced_wait)
    span, idle_us, idle = raw_idle(events)
    ev = Evidence(source="trace")
    ev.__dict__["trace_data"] = [load_trace(tmp_path / "item.json")]
    rule = GpuIdle()
    (f,) = rule.check(ev, rule.options_with({"min-idle-share": 0.1}))  # the control idles 18%
    e = f.evidence
    assert e["idle_share"] == round(idle_us / span, 4) and e["idle_ms_per_step"] == round(idle_us / 1000, 3)
    raw_us = {c: sum(g["us"][c] for g in raw_gaps(events)) for c in CAUSES}
    assert e["idle_by_cause_ms_per_step"] == {c: round(v / 1000, 3) for c, v in raw_us.items()}
    assert raw_us["host synchronisation"] == 7450 - 7152
    charged = [g for g in raw_gaps(events) if g["sync"] is not None]
    assert [g["sync"]["name"] for g in charged] == ["cudaStreamSynchronize"]
    if not untraced_wait:
        assert raw_us["queued work"] < 200
        return
    assert raw_us["queued work"] > 0.5 * idle_us and e["cause"] == "queued work"
    assert f.fix.summary.startswith("The GPU had its next work queued")
    assert f"most idle time is waiting on work already queued ({raw_us['queued work'] / idle_us:.0%} of it)" in f.message
    assert f.cost.ms_per_step == round((idle_us - raw_us["queued work"] - raw_us["untraced"]) / 1000, 3)
    # the largest gap, and the host event covering most of it (ProfilerStep aside), from the raw events
    a, b = max(idle, key=lambda g: g[1] - g[0])
    host = [x for x in events if x["cat"] in ("cpu_op", "user_annotation", "cuda_runtime")
            and not x["name"].startswith("ProfilerStep#")]
    cover = {x["name"]: _overlap([(a, b)], [(x["ts"], x["ts"] + x["dur"])]) for x in host}
    top = max(cover, key=cover.get)
    assert e["largest_gaps"][0] == {"start_ms": round(a / 1000, 3), "ms": round((b - a) / 1000, 3), "host": top,
                                    "host_share": round(cover[top] / (b - a), 3), "file": "train.py", "line": 47,
                                    "cause": "queued work", "queued_by": "same stream"}
    assert top == "aten::item" and (f.locations[0].file, f.locations[0].line) == ("train.py", 47)


def test_gpu_idle_small_a100_syncs_wait_on_a_busy_gpu() -> None:
    """The recorded sync chain (item, event sync, device sync): each sync waits on a busy GPU, so
    what they cause is the idle from their return to the next launch, 0.08 ms of 3.1 ms; the cause
    is host work."""
    (f,) = run(GpuIdle, SMALL)
    causes = raw_causes(str(TRACES / SMALL))
    assert f.evidence["cause"] == "host work"
    assert f.evidence["idle_by_cause_ms_per_step"]["host synchronisation"] == round(causes["host synchronisation"], 3)
    assert 0 < causes["host synchronisation"] < 0.05 * f.evidence["idle_ms_per_step"]


# ---------------------------------------- launch-bound
def raw_short_kernels(name: str) -> tuple[int, int]:
    launches = {e["args"]["correlation"]: e for e in raw(name)
                if e.get("cat") in ("cuda_runtime", "Runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    short = total = 0
    for k in raw(name):
        if k.get("cat") not in ("kernel", "Kernel"):
            continue
        launch = launches.get(k.get("args", {}).get("correlation"))
        if launch is None or launch["name"].startswith("cudaGraphLaunch"):
            continue
        total += 1
        short += k["dur"] < launch["dur"]
    return short, total


def test_launch_bound_v100() -> None:
    (f,) = run(LaunchBound, W0)
    short, total = raw_short_kernels(W0)
    assert f.evidence["short_kernels"] == short and f.evidence["kernels"] == total
    assert f.evidence["short_per_step"] == pytest.approx(short / 6, abs=0.1)
    assert "aten::add_" in f.evidence["ops"]
    assert f.cost.measured is False
    assert any(loc.file == "resnet50_profiler_api.py" for loc in f.locations)


@pytest.mark.parametrize("name", [OWL, RANK0])
def test_launch_bound_quiet_when_short_kernels_are_a_minority(name: str) -> None:
    short, total = raw_short_kernels(name)
    assert short > 1000 and short / total < 0.5
    assert run(LaunchBound, name) == []


def test_launch_bound_owlv2_is_quiet_by_its_share_alone() -> None:
    """The figures the rule's docstring gives for this recording; lowering min-share flags it."""
    short, total = raw_short_kernels(OWL)
    assert (short, total, len(raw_steps(OWL))) == (1331, 4330, 1)
    (f,) = run(LaunchBound, OWL, **{"min-share": 0.3})
    assert (f.evidence["short_per_step"], f.evidence["short_share"]) == (short, round(short / total, 4))
    assert f.cost.ms_per_step == pytest.approx(3.0, abs=0.05)


# ---------------------------------------- dataloader-on-device
@pytest.mark.parametrize("name", [OWL, W0, W4])
def test_dataloader_on_device_quiet_on_cpu_pipelines(name: str) -> None:
    loader = [e for e in raw(name)
              if e.get("ph") == "X" and "DataLoader" in e.get("name", "") and "__next__" in e["name"]]
    assert loader
    calls = [e for e in raw(name) if e.get("cat") in ("cuda_runtime", "Runtime", "cuda_driver")]
    assert not any(d["ts"] <= c["ts"] < d["ts"] + d["dur"] and str(c["tid"]) == str(d["tid"])
                   for d in loader for c in calls)
    assert run(DataloaderOnDevice, name) == []


def loader_trace(tmp_path: Path, inside_next: list[dict]) -> Evidence:
    """Two ProfilerSteps of a loader with num_workers=0: `inside_next` (events with ts relative to
    the step, 20..300 us) happen inside `__next__`; the step proper then copies the batch from
    pinned memory and runs a kernel (outside the loader: never counted)."""
    events = []
    for step in range(2):
        t0 = step * 1000
        events += [
            {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": 1, "tid": 1, "ts": t0,
             "dur": 900},
            {"ph": "X", "cat": "user_annotation", "name": "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__",
             "pid": 1, "tid": 1, "ts": t0 + 10, "dur": 300},
            *({**e, "ts": t0 + e["ts"], "args": {k: (v + 1000 * step if k == "correlation" else v)
                                                   for k, v in e.get("args", {}).items()}} for e in inside_next),
            {"ph": "X", "cat": "cpu_op", "name": "aten::to", "pid": 1, "tid": 1, "ts": t0 + 400, "dur": 30},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "pid": 1, "tid": 1, "ts": t0 + 405,
             "dur": 10, "args": {"correlation": 500 + step}},
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "pid": 0, "tid": 7,
             "ts": t0 + 410, "dur": 5, "args": {"correlation": 500 + step, "bytes": 4096}},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": t0 + 500,
             "dur": 10, "args": {"correlation": 600 + step}},
            {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": t0 + 520, "dur": 50,
             "args": {"correlation": 600 + step}},
        ]
    path = tmp_path / "loader.json"
    path.write_text(json.dumps({"traceEvents": events}))
    ev = Evidence(source="trace")
    ev.__dict__["trace_data"] = [load_trace(path)]
    return ev


def runtime_call(name: str, ts: int, correlation: int, dur: int = 15) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur,
            "args": {"correlation": correlation}}


def test_dataloader_on_device_flags_kernels_inside_next(tmp_path: Path) -> None:
    """A synthetic trace (no fixture has this pattern): a dataset that builds tensors on the GPU."""
    ev = loader_trace(tmp_path, [
        {"ph": "X", "cat": "python_function", "name": "my_dataset.py(17): __getitem__", "pid": 1, "tid": 1,
         "ts": 20, "dur": 100},
        {"ph": "X", "cat": "cpu_op", "name": "aten::to", "pid": 1, "tid": 1, "ts": 30, "dur": 60},
        runtime_call("cudaMemcpyAsync", 40, 10, dur=20),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "pid": 0, "tid": 7,
         "ts": 45, "dur": 5, "args": {"correlation": 10, "bytes": 4096}}])
    rule = DataloaderOnDevice()
    (f,) = rule.check(ev, rule.default_options())
    assert f.evidence["calls"] == 2 and f.evidence["copies"] == 2 and f.evidence["copy_bytes"] == 8192
    assert f.evidence["ops"] == {"aten::to": 2}
    assert (f.locations[0].file, f.locations[0].line) == ("my_dataset.py", 17)
    assert list(rule.check(ev, rule.options_with({"min-launches-per-step": 2}))) == []


def pin_memory_op(*calls: dict) -> list[dict]:
    """What `pin_memory=True` records inside `__next__` with num_workers=0: the batch copied into a
    page-locked host buffer (a host-to-host copy on the CPU), the buffer from the pinned allocator."""
    return [{"ph": "X", "cat": "cpu_op", "name": "aten::pin_memory", "pid": 1, "tid": 1, "ts": 150, "dur": 140},
            {"ph": "X", "cat": "cpu_op", "name": "aten::_pin_memory", "pid": 1, "tid": 1, "ts": 152, "dur": 135},
            {"ph": "X", "cat": "cpu_op", "name": "aten::empty", "pid": 1, "tid": 1, "ts": 155, "dur": 60},
            *calls,
            {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "pid": 1, "tid": 1, "ts": 220, "dur": 60}]


@pytest.mark.parametrize("api", ["cudaHostAlloc", "cudaMallocHost", "cuMemHostAlloc", "cuMemAllocHost_v2",
                                 "cudaHostRegister"])
def test_dataloader_on_device_quiet_when_pin_memory_only_pins_host_memory(tmp_path: Path, api: str) -> None:
    """pin_memory=True with num_workers=0 pins each batch inside `__next__`: a page-locked host
    buffer, no GPU tensor. Flagging it would tell a correct loader to set pin_memory=True."""
    ev = loader_trace(tmp_path, pin_memory_op(runtime_call(api, 160, 20)))
    rule = DataloaderOnDevice()
    assert list(rule.check(ev, rule.default_options())) == []


def test_dataloader_on_device_quiet_on_the_pinned_allocators_event_queries(tmp_path: Path) -> None:
    """Before reusing a pinned block the allocator polls the events recorded by earlier
    non_blocking copies (cudaEventQuery); recent profilers pair such a call with a GPU-side
    `cuda_sync` "Event Sync" row, as the A100 fixture shows. A poll is not GPU work."""
    small = raw(SMALL)
    queries = {e["args"]["correlation"] for e in small if e.get("name") == "cudaEventQuery"}
    assert any(e.get("cat") == "cuda_sync" and e["args"].get("correlation") in queries for e in small)
    sync_row = {"ph": "X", "cat": "cuda_sync", "name": "Event Sync", "pid": 0, "tid": -1, "ts": 201, "dur": 2,
                "args": {"correlation": 21, "wait_on_stream": 7, "stream": -1}}
    ev = loader_trace(tmp_path, pin_memory_op(runtime_call("cudaHostAlloc", 160, 20),
                                              runtime_call("cudaEventQuery", 200, 21, dur=3), sync_row))
    rule = DataloaderOnDevice()
    assert list(rule.check(ev, rule.default_options())) == []


@pytest.mark.parametrize("api", ["cudaMalloc", "cudaMallocAsync", "cuMemAlloc_v2"])
def test_dataloader_on_device_still_flags_device_allocations_inside_next(tmp_path: Path, api: str) -> None:
    """The control for the two tests above: the same pinning loader whose dataset also grows the
    device cache (a `.to("cuda")` in `__getitem__`) is flagged, for that allocation only."""
    to_device = [{"ph": "X", "cat": "cpu_op", "name": "aten::to", "pid": 1, "tid": 1, "ts": 40, "dur": 60},
                 runtime_call(api, 50, 22)]
    ev = loader_trace(tmp_path, to_device + pin_memory_op(runtime_call("cudaHostAlloc", 160, 20)))
    rule = DataloaderOnDevice()
    (f,) = rule.check(ev, rule.default_options())
    assert f.evidence["calls"] == 2 and f.evidence["kernels"] == 0 and f.evidence["copies"] == 0
    assert f.evidence["ops"] == {"aten::to": 2}


# ---------------------------------------- amp-opportunity
def test_amp_opportunity_v100_fp32_convs() -> None:
    (f,) = run(AmpOpportunity, W0)
    kernels = [e for e in raw(W0) if e.get("cat") == "Kernel"]
    total_ms = sum(e["dur"] for e in kernels) / 1000 / 6
    surely_fp32 = sum(e["dur"] for e in kernels if re.search(r"sgemm|scudnn", e["name"])) / 1000 / 6
    assert f.evidence["kernel_ms_per_step"] == pytest.approx(total_ms, abs=1e-3)
    assert surely_fp32 <= f.evidence["fp32_ms_per_step"] <= total_ms
    assert f.evidence["compute_capability"] == "7.0"
    assert f.fix.changes_numerics and f.fix.config["torch.autocast"]["dtype"] == "float16"  # no bf16 on Volta


def fp32_matmul_or_conv(name: str) -> bool:
    """The test's own reading of a V100 (cuDNN 8 / cuBLAS) kernel name: fp32 GEMMs (`sgemm`,
    `scudnn`: s = single precision) and cuDNN's float convolution engines (dgrad, wgrad, winograd,
    im2col); not batch norm, pooling, elementwise or layout kernels."""
    if "sgemm" in name or "scudnn" in name:
        return True
    return ("cudnn::" in name and "<float" in name
            and any(part in name for part in ("dgrad", "wgrad", "winograd", "im2col")))


def test_amp_opportunity_v100_fp32_ms_and_share_recomputed() -> None:
    (f,) = run(AmpOpportunity, W0)
    kernels = [e for e in raw(W0) if e.get("cat") == "Kernel"]
    steps = len(raw_steps(W0))
    total = sum(e["dur"] for e in kernels)
    fp32 = [e for e in kernels if fp32_matmul_or_conv(e["name"])]
    fp32_us = sum(e["dur"] for e in fp32)
    assert steps == 6 and 0.5 < fp32_us / total < 0.8  # most of ResNet-50's GPU time is convolution
    assert not any(re.search(r"884|1688|16816|hmma|f16|bf16|tf32", e["name"]) for e in kernels)  # all fp32
    assert f.evidence["fp32_kernels"] == len(fp32)
    assert f.evidence["fp32_ms_per_step"] == pytest.approx(fp32_us / 1000 / steps, abs=1e-3)
    assert f.evidence["kernel_ms_per_step"] == pytest.approx(total / 1000 / steps, abs=1e-3)
    assert f.evidence["eligible_share"] == pytest.approx(fp32_us / total, abs=1e-4)
    assert f.evidence["reduced_ms_per_step"] == 0
    # the device model's estimate (V100 SXM2: fp16 tensor cores 125 against fp32 15.7 TFLOP/s, each
    # operator at the share of its roofline it reached in fp32, half the bytes): 65.7 -> 10.1 ms/step
    assert f.evidence["device"] == "v100-sxm2" and f.evidence["estimate_float16_ms_per_step"] == pytest.approx(10.14, abs=0.05)
    assert f.cost.ms_per_step == pytest.approx(fp32_us / 1000 / steps - 10.14, abs=0.05)
    assert "V100 SXM2" in f.cost.note and not f.cost.measured


@pytest.mark.parametrize("name", [OWL, BERT, RANK0, DDP])
def test_amp_opportunity_quiet_with_tensor_core_kernels(name: str) -> None:
    names = {e["name"] for e in raw(name) if e.get("cat") == "kernel"}
    assert any(re.search(r"1688|16816|bf16", n) for n in names)  # these already use tensor cores
    assert run(AmpOpportunity, name) == []


# ---------------------------------------- host-sync (trace half)
def sync_findings(name: str, **options: Any) -> dict[str, Finding]:
    opts = HostSync.options_with(options)
    return {f.evidence["op"]: f for f in HostSync().trace_findings(evidence(name), opts)}


def in_steps(name: str, events: list[dict]) -> list[dict]:
    steps = raw_steps(name)
    return [e for e in events if any(lo <= e["ts"] < hi for lo, hi in steps)]


def raw_sync_cost(name: str, calls: list[list[dict]]) -> tuple[float, float]:
    """(us of GPU idle charged to these calls, us their removal saves on the critical path), from
    the raw events (tests/raw_gaps.py): each call (its blocking rows) is charged the idle from it
    until its thread's next launch, never idle with the next GPU op already queued, and saves the
    smaller of that and the host's wait in it."""
    return sync_costs(str(TRACES / name), calls)


def test_host_sync_owlv2_to_copies() -> None:
    """The 80 `.to()` calls that wait at one site: each syncs its stream, and 55 of them first
    copy to pageable memory (which waits as a sync does). The host waits ~370 ms, but the GPU is
    busy through nearly all of it: the GPU idles 5.1 ms after them until the host's next launch, and
    removing them saves 2.0 ms on the critical path (per call, the smaller of the host's wait and
    that idle). Until the gap attribution (auditor.evidence.trace.gaps) the cost was all idle from
    each sync to the GPU's next work, 13.5 ms, 5.0 ms of it with the next work already queued."""
    found = sync_findings(OWL)
    calls = in_steps(OWL, raw_blocking(raw(OWL)))
    syncs = [e for e in calls if e["name"] == "cudaStreamSynchronize"]
    copies = [e for e in calls if e["name"] == "cudaMemcpyAsync"]
    f = found["aten::to"]
    assert f.rule == "host-sync" and f.severity == "warning"
    assert (len(syncs), len(copies)) == (80, 55)
    assert f.evidence["syncs"] == len(raw_op_calls(OWL)["aten::to"]) == 80  # calls, not runtime rows
    assert f.evidence["apis"] == {"cudaStreamSynchronize": 80, "cudaMemcpyAsync to pageable memory": 55}
    assert f.evidence["blocked_ms"] == pytest.approx(sum(e["dur"] for e in syncs + copies) / 1000, abs=1e-3)
    assert 360 < f.evidence["blocked_ms"] < 380
    idle, saving = raw_sync_cost(OWL, raw_op_calls(OWL)["aten::to"])
    assert f.evidence["gpu_idle_ms_per_step"] == pytest.approx(idle / 1000, abs=1e-3) and 4 < idle / 1000 < 6
    assert f.cost.ms_per_step == pytest.approx(saving / 1000, abs=1e-3) and 1 < saving / 1000 < 3
    assert (f.locations[0].file, f.locations[0].line) == ("transformers/models/owlv2/modeling_owlv2.py", 1421)


def test_host_sync_a100_rank0_ignores_cpu_items_and_counts_the_copies() -> None:
    """~945 item() on CPU tensors wait for nothing; the 75 stream syncs and 30 copies to pageable
    memory under `.to()` do: 71% of the step with the host blocked. The GPU idles 92 ms per step
    meanwhile, but with its next work already queued (graph launches by another thread ~66 ms
    before each gap): those syncs did not cause it, and removing them saves 0.44 ms per step, not
    the 96.38 ms the cost claimed while all idle from a sync to the GPU's next work was the sync's."""
    items = [e for e in raw(RANK0) if e.get("name") == "aten::item"]
    assert len(items) > 900  # item() on CPU tensors: no sync follows them
    found = sync_findings(RANK0)
    assert not any("item" in op or "_local_scalar_dense" in op for op in found)
    calls = in_steps(RANK0, raw_blocking(raw(RANK0)))
    stream = [e for e in calls if e["name"] == "cudaStreamSynchronize"]
    copies = [e for e in calls if e["name"] == "cudaMemcpyAsync"]
    assert (len(stream), len(copies)) == (75, 30)
    f = found["aten::to"]
    assert f.evidence["syncs"] == len(raw_op_calls(RANK0)["aten::to"]) == 75  # each copy is in a synced .to()
    blocked = sum(e["dur"] for e in stream + copies) / 1000
    assert f.evidence["blocked_ms"] == pytest.approx(blocked, abs=1e-3)
    steps = raw_steps(RANK0)
    step_ms = (steps[-1][1] - steps[0][0]) / len(steps) / 1000  # (the run's time per step: every share's)
    assert blocked / len(steps) / step_ms > 0.7 and f.severity == "warning"
    assert f"({blocked / len(steps) / step_ms:.1%} of the run's time)" in f.message
    idle, saving = (x / 1000 / len(steps) for x in raw_sync_cost(RANK0, raw_op_calls(RANK0)["aten::to"]))
    assert f.evidence["gpu_idle_ms_per_step"] == pytest.approx(idle, abs=1e-3) and idle < 1.0
    assert f.cost.ms_per_step == pytest.approx(saving, abs=1e-3) and saving < 0.5
    assert f.cost.share_of_step == pytest.approx(saving / step_ms, abs=1e-4)
    assert 90 < f.evidence["queued_idle_ms_per_step"] < 93
    assert "with its next work already queued: it waited on a dependency" in f.message
    # The 158 ms cudaDeviceSynchronize starts after the last ProfilerStep: the profiler's own sync
    # when it stops, not the step's.
    assert sum(f.evidence["syncs"] for f in found.values()) == sum(map(len, raw_op_calls(RANK0).values()))


@pytest.mark.parametrize("name", [RANK0, W0, W4, DDP, OWL])
def test_host_sync_leaves_out_the_profilers_stop_sync(name: str) -> None:
    last_end = max(end for _, end in raw_steps(name))
    after = [e for e in raw(name) if e.get("name") == "cudaDeviceSynchronize" and e["ts"] >= last_end]
    assert len(after) == 1 and after[0]["ts"] - last_end < 200  # us: the profiler stopping
    reported = sum(f.evidence["apis"].get("cudaDeviceSynchronize", 0) for f in sync_findings(name).values())
    inside = [e for e in raw(name) if e.get("name") == "cudaDeviceSynchronize"
              and any(lo <= e["ts"] < hi for lo, hi in raw_steps(name))]
    assert reported == len(inside)


@pytest.mark.parametrize("name", [BERT, SMALL])
def test_host_sync_item_chain(name: str) -> None:
    found = sync_findings(name)
    f = next(f for f in found.values() if "cudaStreamSynchronize" in f.evidence["apis"])
    chain = next(iter(f.evidence["op_chains"]))
    assert "aten::item" in chain and "aten::_local_scalar_dense" in chain
    assert f.severity == "info"  # microseconds: reported, not alarming


def test_host_sync_small_a100_event_synchronize() -> None:
    """cudaEventSynchronize is a sync of its own (no operator issues it): reported under its API
    name, with its count and the time the host was blocked in it."""
    (lo, hi), = raw_steps(SMALL)
    calls = [e for e in raw(SMALL) if e.get("name") == "cudaEventSynchronize" and lo <= e["ts"] < hi]
    assert len(calls) == 1 and calls[0]["dur"] > 10
    assert any(e.get("cat") == "cuda_sync" and e["name"] == "Event Sync"
               and e["args"]["correlation"] == calls[0]["args"]["correlation"] for e in raw(SMALL))
    f = sync_findings(SMALL)["cudaEventSynchronize"]
    assert f.evidence["syncs"] == len(calls)
    assert f.evidence["apis"] == {"cudaEventSynchronize": len(calls)}
    assert f.evidence["blocked_ms"] == pytest.approx(sum(e["dur"] for e in calls) / 1000, abs=1e-3)
    # the cost: what removing the wait saves (one step), at most the host's blocked time
    idle, saving = raw_sync_cost(SMALL, [calls])
    assert f.cost.ms_per_step == pytest.approx(saving / 1000, abs=1e-3) and saving <= sum(e["dur"] for e in calls)
    assert f.evidence["gpu_idle_ms_per_step"] == pytest.approx(idle / 1000, abs=1e-3)
    assert f.cost.share_of_step == pytest.approx(saving / (hi - lo), abs=1e-4)


def test_host_sync_min_syncs_option() -> None:
    calls = len(raw_op_calls(OWL)["aten::to"])  # (the option counts op calls, as `syncs` does)
    assert "aten::to" not in sync_findings(OWL, **{"trace-min-syncs": calls + 1})
    assert "aten::to" in sync_findings(OWL, **{"trace-min-syncs": calls})


# The names torch gives its annotations and wrappers: never the operator the user called.
RAW_NOT_AN_OP = re.compile(r"^(ProfilerStep#\d+|enumerate\(DataLoader\)#.*|## .* ##|Optimizer\..*|"
                           r"autograd::engine::evaluate_function: .*)$")


@cache
def raw_op_calls(name: str) -> dict[str, list[list[dict]]]:
    """The blocking runtime calls inside the ProfilerSteps, grouped into the operator calls that
    issued them, from the raw events: {op name: [[rows of one call], ...]}. A row's call is the
    outermost `ns::op` (else outermost operator) on its thread whose span holds the row's start,
    annotations aside; a row under no operator is a call of its own, named by its API."""
    events = raw(name)
    ops: dict[tuple, list[dict]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "Operator") and not RAW_NOT_AN_OP.match(e["name"]):
            ops.setdefault((e["pid"], e["tid"]), []).append(e)
    calls: dict[tuple, list[dict]] = {}
    for row in in_steps(name, raw_blocking(events)):
        around = sorted((o for o in ops.get((row["pid"], row["tid"]), [])
                         if o["ts"] <= row["ts"] < o["ts"] + o["dur"]), key=lambda o: (o["ts"], -o["dur"]))
        named = [o for o in around if "::" in o["name"]]
        top = (named or around or [row])[0]
        calls.setdefault((top["name"], top["pid"], top["tid"], top["ts"]), []).append(row)
    out: dict[str, list[list[dict]]] = {}
    for key, rows in calls.items():
        out.setdefault(key[0], []).append(rows)
    return out


def _union_us(rows: list[dict]) -> float:
    return sum(b - a for a, b in _merge([(e["ts"], e["ts"] + e["dur"]) for e in rows]))


@pytest.mark.parametrize("name,op,calls", [(SMALL, "aten::is_nonzero", 1), (OWL, "aten::to", 80),
                                           (RANK0, "aten::to", 75)])
def test_host_sync_counts_op_calls_not_the_runtime_rows_in_them(name: str, op: str, calls: int) -> None:
    """A copy to pageable memory blocks the host, and the stream sync that follows it in the same
    `.to()` / `.item()` blocks again: one call the user made, waited on once (counts as the fixture
    README states them: one is_nonzero; 80 `.to()` on the H100; 75, 15 a step, on A100 rank 0).
    Its blocked time is the union of its rows' time."""
    found = sync_findings(name)
    groups = raw_op_calls(name)
    assert len(groups[op]) == calls and any(len(rows) == 2 for rows in groups[op])  # copy + sync in one call
    f = found[op]
    steps = len(raw_steps(name))
    times = "once" if calls == 1 else f"{calls} times"
    assert f.message.startswith(f"The host waits for the GPU: read values less often. In {name}, {op} blocked the host "
                                f"on the GPU {times} ({per_step(calls / steps)} per step)")
    assert f.evidence["syncs"] == calls and f.evidence["syncs_per_step"] == round(calls / steps, 2)
    blocked = [_union_us(rows) for rows in groups[op]]
    assert f.evidence["blocked_ms"] == pytest.approx(sum(blocked) / 1000, abs=1e-3)
    assert f.evidence["longest_ms"] == pytest.approx(max(blocked) / 1000, abs=1e-3)
    assert sum(s["syncs"] for s in f.evidence["sites"]) <= calls
    # every finding of the trace: one per issuing op, counting its calls
    assert {o: g.evidence["syncs"] for o, g in found.items()} == {o: len(c) for o, c in groups.items()}
    # what removing them saves: per call (a row or two), the smaller of its wait and its idle
    assert f.cost.ms_per_step == pytest.approx(raw_sync_cost(name, groups[op])[1] / 1000 / steps, abs=1e-3)


def test_host_sync_nested_waits_are_one_call_and_their_time_once(tmp_path: Path) -> None:
    """A driver-level sync recorded inside the runtime sync that made it (both are blocking
    calls) is the same wait: one call, its time counted once, not the sum of the rows."""
    def x(cat: str, name: str, ts: int, dur: int, **args: Any) -> dict:
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur, "args": args}

    events = [x("user_annotation", "ProfilerStep#1", 0, 1000),
              x("cpu_op", "aten::item", 100, 500), x("cpu_op", "aten::_local_scalar_dense", 110, 480),
              x("cuda_runtime", "cudaStreamSynchronize", 200, 300, correlation=1),
              x("cuda_driver", "cuStreamSynchronize", 210, 280, correlation=2)]
    (tmp_path / "nested.json").write_text(json.dumps({"traceEvents": events}))
    ev = Evidence(source="trace", traces=[str(tmp_path / "nested.json")])
    ev.__dict__["trace_data"] = [load_trace(tmp_path / "nested.json")]
    [f] = HostSync().trace_findings(ev, HostSync.default_options())
    assert f.evidence["op"] == "aten::item" and f.evidence["syncs"] == 1
    assert f.evidence["blocked_ms"] == f.evidence["longest_ms"] == 0.3  # the outer call's 300 us, once
    assert "once" in f.message and f.evidence["apis"] == {"cudaStreamSynchronize": 1, "cuStreamSynchronize": 1}


# ---------------------------------------- dataloader-bound (trace half)
def raw_loader_shares(name: str) -> list[float]:
    loader = [(e["ts"], e["ts"] + e["dur"]) for e in raw(name)
              if e.get("ph") == "X" and re.match(r"enumerate\(DataLoader\)#.*__next__$", e.get("name", ""))]
    out = []
    for lo, hi in raw_steps(name):
        inside = sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in loader)
        out.append(inside / (hi - lo))
    return out


def dl_findings(name: str) -> list[Finding]:
    return DataloaderBound().trace_findings(evidence(name), DataloaderBound.default_options())


def test_dataloader_workers0_flagged() -> None:
    shares = raw_loader_shares(W0)
    assert min(shares) > 0.29 and max(shares) < 0.45
    (f,) = dl_findings(W0)
    assert [s["share"] for s in f.evidence["steps"]] == pytest.approx(shares, abs=1e-4)
    assert f.fix.config["num_workers"] == 4
    assert (f.locations[0].file, f.locations[0].line) == ("resnet50_profiler_api.py", 42)


def test_dataloader_workers4_quiet() -> None:
    shares = raw_loader_shares(W4)
    assert max(shares) < 0.03
    assert dl_findings(W4) == []


def test_dataloader_owlv2_half_the_step() -> None:
    (share,) = raw_loader_shares(OWL)
    (f,) = dl_findings(OWL)
    assert f.cost.share_of_step == pytest.approx(share, abs=1e-3) and 0.45 < share < 0.55


# ---------------------------------------- through the engine
def test_engine_runs_and_skips_the_trace_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through run_rules, with the registry narrowed to these rules (registration is tested below)."""
    from auditor.rules import engine

    monkeypatch.setattr(engine, "all_rules", lambda: {r.id: r for r in STANDALONE})
    results = engine.run_rules(evidence(W0))
    assert results.errors == [] and results.skipped == []
    assert {f.rule for f in results.findings} == {"pageable-copy", "gpu-idle", "launch-bound", "amp-opportunity"}
    empty = engine.run_rules(Evidence())
    assert {s["rule"] for s in empty.skipped} == {r.id for r in STANDALONE} and not empty.findings


def test_registered_rules_run_through_the_engine() -> None:
    from auditor.rules.engine import run_rules
    from auditor.rules.registry import all_rules

    ids = {r.id for r in STANDALONE}
    assert ids <= set(all_rules())  # every trace rule is registered (entry points)
    results = run_rules(evidence(W0))
    assert not [e for e in results.errors if e["rule"] in ids]
    fired = {f.rule for f in results.findings}
    assert {"pageable-copy", "gpu-idle", "launch-bound", "amp-opportunity"} <= fired
    assert "dataloader-on-device" not in fired


@pytest.mark.parametrize("body, line, code, note", [
    ("    y = x * 2\n    return y.sum().item()\n", 6, "return y.sum().item()", ""),
    ("    if x.sum().item():\n        return x.item()\n    return 0\n", 5, "",
     "one of lines 5, 6: the trace records helper, not which of its lines"),
    ("    return x\n", 4, "def helper(x):", "the trace records this function, not the line within it"),
])
def test_host_sync_in_a_function_of_a_torch2_trace_names_the_function(tmp_path: Path, body: str, line: int,
                                                                       code: str, note: str) -> None:
    """torch >= 2 traces name a Python function by its first line (`helper.py(4): helper`), not by
    the line inside it that synchronised: the line of its body that can make what ran below the
    frame (`aten::item`: `.item()`, `float(t)`, `if t:`) when exactly one can, the few that can
    named as candidates (no line's source shown as if it were the one), else the def line, and the
    location says so. A
    trace without GPU events (only
    the sync call recorded) shows no launch after the sync, so no idle it caused: its cost is 0 (it
    was all of the host's wait while any idle after a sync was the sync's)."""
    (tmp_path / "helper.py").write_text("import torch\n\n\ndef helper(x):\n" + body)
    events = [
        {"ph": "X", "cat": "python_function", "name": f"{tmp_path / 'helper.py'}(4): helper", "pid": 1, "tid": 1,
         "ts": 100, "dur": 80, "args": {}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::item", "pid": 1, "tid": 1, "ts": 110, "dur": 60, "args": {}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "pid": 1, "tid": 1, "ts": 120, "dur": 40,
         "args": {"correlation": 7}},
    ]
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": events}))
    ev = Evidence(source="trace", traces=[str(tmp_path / "t.json")])
    ev.__dict__["trace_data"] = [load_trace(tmp_path / "t.json")]
    opts = HostSync.default_options()
    [f] = HostSync().trace_findings(ev, opts)
    [loc] = f.locations
    assert (loc.file, loc.line) == (str(tmp_path / "helper.py"), line)
    assert (loc.code, loc.note) == (code, note)
    assert f.evidence["blocked_ms"] == 0.04 and f.cost.ms_per_step == 0.0


def test_host_sync_leaves_out_the_auditors_own_reads(tmp_path: Path) -> None:
    """On an audited CUDA run the numerics checks read their flags once a step, inside an
    `auditor::numerics` range: that sync is the audit's, not the program's, and must not be
    reported as the user's. The small A100 recording with its `is_nonzero` call put inside such a
    range (as the collector's own reads are) keeps the program's other syncs only."""
    events = raw(SMALL)
    call = next(e for e in events if e.get("name") == "aten::is_nonzero")
    doc = {"traceEvents": [*events, {"ph": "X", "cat": "user_annotation", "name": "auditor::numerics",
                                     "pid": call["pid"], "tid": call["tid"], "ts": call["ts"] - 1,
                                     "dur": call["dur"] + 2, "args": {}}]}
    with gzip.open(tmp_path / "audited.pt.trace.json.gz", "wt") as f:
        json.dump(doc, f)
    ev = Evidence(source="trace", traces=[str(tmp_path / "audited.pt.trace.json.gz")])
    ev.__dict__["trace_data"] = [load_trace(tmp_path / "audited.pt.trace.json.gz")]
    opts = HostSync.default_options()
    audited = {f.evidence["op"] for f in HostSync().trace_findings(ev, opts)}
    recorded = set(sync_findings(SMALL))  # the recording as made
    assert "aten::is_nonzero" in recorded and "cudaDeviceSynchronize" in recorded
    assert audited == recorded - {"aten::is_nonzero"}
