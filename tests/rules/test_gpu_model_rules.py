"""The device model's rules on the recorded traces: unfused-attention on the H100 owlv2 trace (the
issue's numbers: softmax ~46% + bmm ~40% of the GPU's time, 48% + 42% of its kernels', the scores' bmm at ~51 TFLOP/s on a
16 x 5185^2 problem) and exposed-comm on one rank of the DDP trace; each silent on a control."""
from __future__ import annotations

import gzip
import json
from bisect import bisect_left
from functools import cache
from pathlib import Path

import pytest

from conftest import FIXTURES, audit

from auditor.config import Config
from auditor.evidence.load import load_paths
from auditor.rules.engine import run_rules

TRACES = FIXTURES / "traces"
OWLV2 = TRACES / "h100_owlv2_syncs_dataloader.pt.trace.json.gz"
DDP = TRACES / "a100_ddp_nccl_2rank.pt.trace.json.gz"


@cache
def _all_findings(path: Path) -> tuple:
    """Every rule's findings on one recording, judged once per module (the tests only read them)."""
    return tuple(run_rules(load_paths([path]), Config()).findings)


def _findings(path: Path, rule_id: str) -> list:
    return [f for f in _all_findings(path) if f.rule == rule_id]


def raw_attention(path: Path) -> dict:
    """The attention chains' figures from the trace's raw events with the standard library: the
    3-D softmaxes (one a chain) and the batched matmuls around them (`aten::bmm` of 3-D inputs but
    the 1-row ones of the box head), the kernels each launched (runtime or driver calls inside the op,
    matched by correlation), their FLOPs (2*b*m*k*n a bmm), and all kernels' time."""
    with gzip.open(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    kernels = {e["args"]["correlation"]: e["dur"] for e in events if e.get("cat") == "kernel"}
    calls: dict[int, list[dict]] = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            calls.setdefault(e["tid"], []).append(e)
    starts = {tid: sorted(c["ts"] for c in cs) for tid, cs in calls.items()}
    for cs in calls.values():
        cs.sort(key=lambda c: c["ts"])

    def kernel_us(op: dict) -> float:
        cs, i, us = calls[op["tid"]], bisect_left(starts[op["tid"]], op["ts"]), 0.0
        while i < len(cs) and cs[i]["ts"] <= op["ts"] + op["dur"]:
            us += kernels.get(cs[i]["args"]["correlation"], 0.0)
            i += 1
        return us

    out = {"chains": 0, "softmax_ms": 0.0, "bmm_ms": 0.0, "flops": 0}
    for e in events:
        dims = e.get("args", {}).get("Input Dims") or [[]]
        if e.get("cat") != "cpu_op" or len(dims[0]) != 3:
            continue
        if e["name"] == "aten::softmax":
            out["chains"] += 1
            out["softmax_ms"] += kernel_us(e) / 1000
        elif e["name"] == "aten::bmm" and dims[0][0] > 1:
            (b, m, k), (_, _, n) = dims[0], dims[1]
            out["bmm_ms"] += kernel_us(e) / 1000
            out["flops"] += 2 * b * m * k * n
    out["kernel_ms"] = sum(kernels.values()) / 1000
    return out


def test_unfused_attention_on_owlv2():
    """Every figure recomputed from the raw events (raw_attention): 180 chains, softmax ~48% and the
    two matmuls ~42% of the kernel time, the fused estimate the chains' FLOPs at half the H100's
    989.5 bf16 TFLOP/s."""
    (f,) = _findings(OWLV2, "unfused-attention")
    ev = f.evidence
    raw = raw_attention(OWLV2)
    assert ev["device"] == "h100-sxm" and ev["dtype"] == "bfloat16"
    assert ev["chains"] == raw["chains"] == 180  # 120 vision (16 x 5185^2) + 60 text (12 x 5^2) attentions
    assert next(iter(ev["shapes"])) == "16x5185x64 @ 16x64x5185 -> softmax 16x5185x5185 @ 16x5185x64"
    parts = ev["parts_ms_per_step"]
    assert parts["softmax"] == pytest.approx(raw["softmax_ms"], abs=1e-3)
    assert parts["scores matmul"] + parts["values matmul"] == pytest.approx(raw["bmm_ms"], abs=2e-3)
    assert ev["parts_share"]["softmax"] == pytest.approx(raw["softmax_ms"] / raw["kernel_ms"], abs=1e-4)
    # the chain's other ops (scale, mask, dropout, casts) add the rest of the attention's time
    chain_ms = raw["softmax_ms"] + raw["bmm_ms"]
    assert 0 <= ev["attention_ms_per_step"] - chain_ms == pytest.approx(parts["scale, mask, dropout, casts"], abs=2e-3)
    assert ev["kernel_share"] == pytest.approx(ev["attention_ms_per_step"] / raw["kernel_ms"], abs=1e-4)
    assert ev["flops_per_step"] == raw["flops"]
    assert ev["fused_estimate_ms_per_step"] == pytest.approx(raw["flops"] / (989.5e12 / 2) * 1e3, abs=1e-3)
    # (what the rule measured; its cost is what that saves on this host-bound step: the device's
    # work the host waits for, tests/rules/test_attribution_host_bound.py)
    assert f.cost.measured is False and ev["measured_ms_per_step"] == pytest.approx(
        ev["attention_ms_per_step"] - ev["fused_estimate_ms_per_step"], abs=1e-3)
    assert f.cost.ms_per_step == pytest.approx(ev["waited_ms_per_step"], abs=1e-3)
    assert "H100 SXM" in f.cost.note
    loc = f.locations[0]
    assert loc.file.endswith("transformers/models/owlv2/modeling_owlv2.py") and loc.line == 410
    assert "scaled_dot_product_attention" in f.fix.summary and f.fix.config == {"attn_implementation": "sdpa"}


@pytest.mark.parametrize("control", ["h100_bert_small_item_sync", "v100_resnet50_dataloader_workers0",
                                     "a100_ddp_nccl_2rank"])
def test_unfused_attention_is_silent_without_the_chain(control):
    """BERT here already runs scaled_dot_product_attention; ResNet has no attention; the DDP trace
    records no shapes."""
    assert _findings(TRACES / f"{control}.pt.trace.json.gz", "unfused-attention") == []


def test_exposed_comm_on_one_ddp_rank():
    (f,) = _findings(DDP, "exposed-comm")
    ev = f.evidence
    assert ev["per_step_exposed_ms"] == pytest.approx([10.164, 10.54, 18.856], abs=0.01)
    assert ev["exposed_comm_ms_per_step"] == pytest.approx(13.19, abs=0.01)
    assert ev["comm_ms_per_step"] == pytest.approx(15.63, abs=0.02)
    allreduce = ev["collectives"]["allreduce"]
    assert allreduce["count"] == 15 and allreduce["mb_per_step"] == pytest.approx(102.2, abs=0.1)
    assert allreduce["bus_gbps"] == pytest.approx(6.56, abs=0.05)
    assert ev["world_size"] == 2 and ev["device"] == "a100-sxm4-40gb"
    assert f.cost.measured is True and ev["measured_ms_per_step"] == pytest.approx(13.19, abs=0.01)
    # (the rank's step is host-bound and its host waits for none of the device's work in a sync:
    # overlapping the communication takes nothing off it; tests/rules/test_attribution_host_bound.py)
    assert ev["bound"] == "host" and f.cost.ms_per_step == pytest.approx(ev["waited_ms_per_step"], abs=1e-3) == 0
    assert "only where the host waits for the device" in f.message
    assert "bucket_cap_mb" in f.fix.summary and "no_sync" in f.fix.summary


@pytest.mark.parametrize("control", ["h100_owlv2_syncs_dataloader", "v100_resnet50_dataloader_workers4"])
def test_exposed_comm_is_silent_on_a_single_gpu(control):
    assert _findings(TRACES / f"{control}.pt.trace.json.gz", "exposed-comm") == []


def test_explain_reads_the_docs(tmp_path):
    for rule_id, words in (("unfused-attention", "scaled_dot_product_attention"), ("exposed-comm", "no_sync")):
        a = audit("explain", rule_id, out=tmp_path)
        assert a.returncode == 0 and words in a.stdout and "min-share" in a.stdout


def test_amp_opportunity_estimate_by_hand(tmp_path):
    """One fp32 4096^3 matmul whose sgemm kernel takes 10 ms on an A100 80GB: it reached
    (2*4096^3 / 19.5 TFLOP/s) / 10 ms = 70.5% of its fp32 roofline; at that share of the bf16 roof
    (312 TFLOP/s) it takes 10 ms * 19.5 / 312 = 0.625 ms, with TF32 (156) 1.25 ms."""
    from test_efficiency import write_matmul_trace

    path = write_matmul_trace(tmp_path / "fp32.pt.trace.json", 4096, 4096, 4096, kernel_us=10_000.0,
                              step_us=20_000.0, dtype="float", kernel="ampere_sgemm_128x64_nn")
    (f,) = _findings(path, "amp-opportunity")
    assert f.evidence["device"] == "a100-sxm4-80gb"
    assert f.evidence["estimate_bfloat16_ms_per_step"] == pytest.approx(0.625, abs=1e-3)
    assert f.evidence["estimate_tf32_ms_per_step"] == pytest.approx(1.25, abs=1e-3)
    assert f.evidence["measured_ms_per_step"] == pytest.approx(10 - 0.625, abs=1e-3) and f.cost.measured is False
    assert "A100 SXM4 80GB" in f.cost.note and "312" in f.cost.note
    # (its step is host-bound, 20 ms on the host against the kernel's 10, and the host never waits
    # for the device: a faster kernel takes nothing off it, and the message says so)
    assert f.cost.ms_per_step == 0 and "only where the host waits for the device" in f.message
    # a GPU the table does not know: the stated floor, half the fp32 time
    unknown = dict(name="NVIDIA Imaginary X1", totalGlobalMem=1 << 34, computeMajor=9, computeMinor=0, numSms=10, id=0)
    path = write_matmul_trace(tmp_path / "x1.pt.trace.json", 4096, 4096, 4096, kernel_us=10_000.0,
                              step_us=20_000.0, dtype="float", kernel="ampere_sgemm_128x64_nn", device=unknown)
    (f,) = _findings(path, "amp-opportunity")
    assert f.evidence["measured_ms_per_step"] == 5.0 and "half" in f.cost.note


REHEARSED = """import torch
from torch import nn

model = nn.Linear(256, 256).to("cuda")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
host = torch.randn(2048, 256)
log = []


def step(i):
    x = host.to("cuda")
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    log.append(loss.item())
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.empty_cache()
"""


@pytest.mark.slow
def test_rehearsed_costs_are_estimated_on_the_named_device(tmp_path):
    """A rehearsed step (no GPU here) with a 2 MiB pageable copy, an .item(), a peak-stat reset and
    an empty_cache() a step, audited with --device h100-sxm: every GPU cost is the H100 row's
    estimate (copy 2.1 MB at 20 GB/s = 0.105 ms; each sync 10 us), unmeasured, named in the note,
    ranked; the reset, which does not synchronise, costs its calls' host time as rehearsed."""
    (tmp_path / "rehearsed.py").write_text(REHEARSED)
    a = audit("run", f"{tmp_path / 'rehearsed.py'}:step", "--steps", "6", "--no-profile", "--no-numerics",
              "--device", "h100-sxm", "-q", out=tmp_path / "o")
    assert a.returncode == 0, a.stderr
    assert a.findings_doc["environment"]["rehearsal"] is True
    costs = {f["rule"]: f["cost"] for f in a.findings}
    assert costs["pageable-copy"]["ms_per_step"] == pytest.approx(2048 * 256 * 4 / 20e9 * 1e3, abs=1e-3)
    for rule in ("host-sync", "forced-cleanup"):
        assert costs[rule]["ms_per_step"] == pytest.approx(0.01), rule
    for rule in ("pageable-copy", "host-sync", "forced-cleanup"):
        assert costs[rule]["measured"] is False and "NVIDIA H100 SXM 80GB (--device)" in costs[rule]["note"]
    resets = sorted(t["ms"] for s in a.evidence["steps"] for t in s["tallies"] if t["kind"] == "stat-reset")
    assert len(resets) == 6
    reset = costs["peak-stats-reset"]
    assert reset["ms_per_step"] == pytest.approx((resets[2] + resets[3]) / 2, abs=2e-3)
    assert "host time, with no device sync, as rehearsed" in reset["note"]
    assert [f["rule"] for f in a.findings][0] == "pageable-copy"  # the largest estimate first


COMPUTE_HEAVY = """import torch
from torch import nn

model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024)).to("cuda")
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(1024, 1024, device="cuda")


def step(i):
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()
"""


@pytest.mark.slow
def test_a_rehearsed_step_whose_cpu_does_the_kernels_work_is_not_called_host_bound(tmp_path):
    """Two 1024-wide matmul layers on a 1024-row batch, rehearsed: this CPU's step is mostly the
    matmuls themselves, which a GPU takes off the host. The host's time here says nothing of its
    issue time there, so the bound is named only where a floor of that issue time (its data waits
    and a launch time per kernel) exceeds the kernels' estimate (host-bound) or the kernels exceed
    all of the host's time here (device-bound); between the two it is not known."""
    (tmp_path / "heavy.py").write_text(COMPUTE_HEAVY)
    a = audit("run", f"{tmp_path / 'heavy.py'}:step", "--steps", "3", "--no-profile", "--no-numerics",
              "--device", "h100-sxm", "-q", out=tmp_path / "o")
    assert a.returncode == 0, a.stderr
    clock = a.findings_doc["steps"]["clock"]
    launches = [sum(t["count"] for t in s["tallies"] if t["kind"] == "device-launch") for s in a.evidence["steps"]]
    assert {t["data"]["grad"] for s in a.evidence["steps"] for t in s["tallies"] if t["kind"] == "device-launch"} == {1}
    floor = sorted(launches)[1] * 3 * 5 / 1000  # (3 steps: the median; the H100 row's 5 us a launch, x3: all recorded)
    assert clock["source"] == "estimate" and clock["issue_floor_ms"] == pytest.approx(floor, abs=1e-3)
    assert clock["issue_floor_ms"] < clock["device_ms"] < clock["host_ms"]
    assert clock["bound"] is None
    summary = (a.out / "summary.txt").read_text()
    assert "step clock: on an NVIDIA H100 SXM 80GB this step's bound is not known from a rehearsal" in summary
    assert f"the host would take at least {floor:.2f} ms a step to issue it" in summary


EVALUATED = """import torch

w = torch.nn.Parameter(torch.randn(64, 64, device="cuda"))
opt = torch.optim.SGD([w], lr=0.01)
big = torch.randn(2048, 2048, device="cuda")


def step(i):
    opt.zero_grad()
    (w.sum() ** 2).backward()
    opt.step()
    with torch.no_grad():
        y = big @ big  # 2 * 2048^3 = 17.2 GFLOP, no backward
"""


@pytest.mark.slow
def test_work_autograd_does_not_record_is_not_tripled_for_a_backward(tmp_path):
    """A step whose big matmul runs under no_grad (an evaluation's forward, a metric): the device
    model prices it once, as the GPU runs it, not x3 as if a backward ran its derivative; the few
    calls autograd records are x3, and amp-opportunity says no backward doubles its FLOPs."""
    (tmp_path / "ev.py").write_text(EVALUATED)
    a = audit("run", f"{tmp_path / 'ev.py'}:step", "--steps", "4", "--no-profile", "--no-numerics",
              "--device", "h100-sxm", "-q", out=tmp_path / "o")
    assert a.returncode == 0, a.stderr
    clock = a.findings_doc["steps"]["clock"]
    [mm] = [t for t in a.evidence["steps"][1]["tallies"] if t["kind"] == "device-launch" and t["data"]["flops"]]
    assert mm["data"]["grad"] == 0 and mm["data"]["flops"] == 2 * 2048 ** 3
    graded = [t for t in a.evidence["steps"][1]["tallies"] if t["kind"] == "device-launch" and t["data"]["grad"]]
    assert graded and all(t["where"]["line"] == 10 for t in graded)  # w.sum() ** 2: the recorded calls
    matmul_ms = 2 * 2048 ** 3 / 67e12 * 1e3  # the H100 SXM row's fp32 peak (67 TFLOP/s): 0.256 ms
    assert clock["device_ms"] == pytest.approx(matmul_ms, rel=0.05)  # (x3 would be 0.77 ms)
    [f] = a.rule("amp-opportunity")
    assert "none of them is recorded for a backward" in f["message"] and f["evidence"]["fp32_recorded_share"] == 0


SMALL_POLICY = """import torch
from torch import nn

net = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)).to("cuda")
opt = torch.optim.Adam(net.parameters())
x = torch.randn(256, 256, device="cuda")


def step(i):
    h = net(x)
    for _ in range(60):  # a soft update's or a loss's many small ops
        h = h * 0.99 + 0.01
    opt.zero_grad()
    h.square().mean().backward()
    opt.step()
"""


@pytest.mark.slow
def test_fp32_matmuls_of_a_step_predicted_host_bound_are_said_not_to_shorten_it(tmp_path):
    """amp-opportunity on a rehearsed step the step clock predicts host-bound on the GPU: its fp32
    matmuls are counted as before, and the message says their kernels are a small part of a step
    the host's launches set, so autocast alone would not shorten it (cleanrl's SAC)."""
    (tmp_path / "policy.py").write_text(SMALL_POLICY)
    a = audit("run", f"{tmp_path / 'policy.py'}:step", "--steps", "4", "--no-profile", "--no-numerics", "-q",
              out=tmp_path / "o")
    assert a.returncode == 0, a.stderr
    clock = a.findings_doc["steps"]["clock"]
    assert clock["bound"] == "host" and clock["device_ms"] < 0.2 * clock["issue_floor_ms"]
    [f] = a.rule("amp-opportunity")
    assert f["evidence"]["fp32_gflop_per_step"] == pytest.approx(3 * 2 * 256 ** 3 / 1e9, rel=1e-3)
    assert (f"but this step is predicted host-bound there: all its kernels take about {clock['device_ms']:.2f} ms "
            f"of the {clock['issue_floor_ms']:.2f} ms the host takes to issue it") in f["message"]
