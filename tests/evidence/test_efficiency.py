"""Kernel efficiency and MFU: computed by hand for a one-matmul step (a synthetic trace of known
dims, kernel time and device), and read off the recorded fixtures (owlv2's unfused attention, the
DDP trace's communication)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import FIXTURES, audit

from auditor.evidence.trace.efficiency import efficiency, kernel_group, op_work
from auditor.evidence.trace.load import load_trace

TRACES = FIXTURES / "traces"
A100_80GB = {"id": 0, "name": "NVIDIA A100-SXM4-80GB", "totalGlobalMem": 84990623744, "computeMajor": 8,
             "computeMinor": 0, "numSms": 108}


def write_matmul_trace(path: Path, m: int, k: int, n: int, kernel_us: float, step_us: float,
                       dtype: str = "c10::BFloat16", device: dict | None = A100_80GB,
                       kernel: str = "sm80_xmma_gemm_bf16bf16_bf16f32_f32_nn_n_tilesize128x128x32",
                       launch: str = "cudaLaunchKernel") -> Path:
    """A Chrome trace of one ProfilerStep running one aten::mm of [m, k] x [k, n] whose one kernel
    takes `kernel_us` (the test helper of the MFU test: every number known)."""
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0.0,
         "dur": step_us, "args": {}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10.0, "dur": 30.0,
         "args": {"External id": 1, "Input Dims": [[m, k], [k, n]], "Input type": [dtype, dtype]}},
        {"ph": "X", "cat": "cuda_runtime", "name": launch, "pid": 1, "tid": 1, "ts": 20.0, "dur": 5.0,
         "args": {"External id": 1, "correlation": 7}},
        {"ph": "X", "cat": "kernel", "name": kernel, "pid": 0, "tid": 7, "ts": 50.0, "dur": kernel_us,
         "args": {"External id": 1, "correlation": 7, "device": 0, "stream": 7}},
    ]
    doc = {"schemaVersion": 1, "traceEvents": events}
    if device is not None:
        doc["deviceProperties"] = [device]
    path.write_text(json.dumps(doc))
    return path


def test_mfu_of_one_matmul_step_by_hand(tmp_path):
    trace = load_trace(write_matmul_trace(tmp_path / "mm.pt.trace.json", 4096, 4096, 4096, kernel_us=1000.0,
                                          step_us=2000.0))
    eff = efficiency(trace)
    assert eff.device.key == "a100-sxm4-80gb" and eff.has_shapes
    flops = 2 * 4096 ** 3  # 137,438,953,472
    (op,) = eff.ops
    assert op.op == "aten::mm" and op.dtype == "bfloat16" and op.count == 1
    assert op.flops == flops and op.kernel_ms == 1.0
    assert op.tflops == pytest.approx(flops / 1e-3 / 1e12)  # 137.44 TFLOP/s over the kernel's 1 ms
    assert op.bytes == 3 * 4096 * 4096 * 2
    assert op.intensity == pytest.approx(flops / (3 * 4096 * 4096 * 2))  # 1365 FLOP/B: above A100's ridge (153)
    assert op.bound == "compute" and op.peak_share == pytest.approx(137.438953472 / 312)
    (step,) = eff.steps
    assert step.step == 1 and step.device == "a100-sxm4-80gb"
    assert step.busy_ms == 1.0 and step.idle_ms == 1.0 and step.comm_ms == 0.0
    assert step.flops == flops
    assert step.achieved_tflops == pytest.approx(68.719476736)  # over the 2 ms step
    assert step.mfu == pytest.approx(68.719476736 / 312)  # 0.2203 of the A100's bf16 peak


def test_a_rocm_trace_gets_the_same_model(tmp_path):
    """A trace recorded on ROCm: hipLaunchKernel, a rocBLAS (Tensile `Cijk_`) kernel, an MI300X."""
    mi300x = {"id": 0, "name": "AMD Instinct MI300X", "totalGlobalMem": 205822885888, "numSms": 304}
    trace = load_trace(write_matmul_trace(tmp_path / "hip.json", 4096, 4096, 4096, kernel_us=500.0, step_us=1000.0,
                                          device=mi300x, kernel="Cijk_Ailk_Bljk_BBS_BH_MT256x256x64_MI32x32x8",
                                          launch="hipLaunchKernel"))
    eff = efficiency(trace)
    assert eff.device.key == "mi300x" and [g.group for g in eff.groups] == ["gemm"]
    assert eff.steps[0].mfu == pytest.approx(2 * 4096 ** 3 / 1e-3 / 1e12 / 1307.4)


def test_an_fp32_matmul_is_judged_by_the_fp32_peak(tmp_path):
    trace = load_trace(write_matmul_trace(tmp_path / "mm.json", 1024, 1024, 1024, kernel_us=200.0, step_us=400.0,
                                          dtype="float"))
    (step,) = efficiency(trace).steps
    assert step.mfu == pytest.approx(2 * 1024 ** 3 / 400e-6 / 1e12 / 19.5)


def test_without_a_known_device_mfu_is_null_until_device_names_one(tmp_path):
    trace = load_trace(write_matmul_trace(tmp_path / "mm.json", 1024, 1024, 1024, kernel_us=200.0, step_us=400.0,
                                          device=None))
    eff = efficiency(trace)
    assert eff.device is None and eff.steps[0].mfu is None and eff.steps[0].flops == 2 * 1024 ** 3
    assert efficiency(trace, "h100-sxm").steps[0].mfu == pytest.approx(2 * 1024 ** 3 / 400e-6 / 1e12 / 989.5)


def test_steps_gpu_in_findings_json(tmp_path):
    path = write_matmul_trace(tmp_path / "mm.pt.trace.json", 4096, 4096, 4096, kernel_us=1000.0, step_us=2000.0)
    a = audit("analyze", str(path), "-q", out=tmp_path / "o")
    assert a.returncode in (0, 1), a.stderr
    (gpu,) = a.findings_doc["steps"]["gpu"]
    assert gpu == {"step": 1, "device": "a100-sxm4-80gb", "busy_ms": 1.0, "idle_ms": 1.0, "comm_ms": 0.0,
                   "exposed_comm_ms": 0.0, "flops": float(2 * 4096 ** 3), "achieved_tflops": 68.719,
                   "mfu": 0.2203}


@pytest.mark.parametrize("name,dims,types,flops", [
    ("aten::addmm", [[1024], [5185, 1024], [1024, 1024]], ["c10::BFloat16"] * 3, 2 * 5185 * 1024 * 1024),
    ("aten::bmm", [[16, 5185, 64], [16, 64, 5185]], ["c10::BFloat16"] * 2, 2 * 16 * 5185 * 5185 * 64),
    ("aten::_scaled_dot_product_flash_attention", [[2, 8, 128, 64], [2, 8, 128, 64], [2, 8, 128, 64]],
     ["c10::BFloat16"] * 3, 4 * 2 * 8 * 128 * 128 * 64),
    ("aten::cudnn_convolution", [[32, 256, 14, 14], [1024, 256, 1, 1]], ["float", "float"],
     2 * 32 * 1024 * 14 * 14 * 256),
])
def test_formulas(name, dims, types, flops):
    assert op_work(name, dims, types)[0] == flops


def test_kernel_groups():
    assert kernel_group("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)") \
        == "communication"
    assert kernel_group("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*)") == "communication"
    assert kernel_group("void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, c10::BFloat16>") == "softmax"
    assert kernel_group("void cutlass::Kernel2<cutlass_75_tensorop_bf16_s1688gemm_bf16_256x128_tn_align1>") == "gemm"
    assert kernel_group("Cijk_Ailk_Bljk_BBS_BH_MT128x128x32") == "gemm"


def test_owlv2_attention_numbers():
    """The issue's numbers: softmax ~46% and bmm ~40% of kernel time, the QK^T bmm at ~51 TFLOP/s
    on a 16 x 5185^2 problem, on an H100 SXM."""
    eff = efficiency(load_trace(TRACES / "h100_owlv2_syncs_dataloader.pt.trace.json.gz"))
    assert eff.device.key == "h100-sxm"
    groups = {g.group: g for g in eff.groups}
    assert groups["softmax"].share == pytest.approx(0.46, abs=0.02)
    qk = next(o for o in eff.ops if o.op == "aten::bmm" and o.shapes == "16x5185x64, 16x64x5185")
    assert qk.count == 120 and qk.tflops == pytest.approx(51, abs=1.5)
    bmm_ms = sum(o.kernel_ms for o in eff.ops if o.op == "aten::bmm")
    kernel_ms = sum(g.ms for g in eff.groups if g.group not in ("memcpy", "memset"))
    assert bmm_ms / kernel_ms == pytest.approx(0.40, abs=0.02)
    (step,) = eff.steps
    assert step.mfu == pytest.approx(0.0246, abs=0.001) and step.comm_ms == 0.0


def test_ddp_trace_communication():
    eff = efficiency(load_trace(TRACES / "a100_ddp_nccl_2rank.pt.trace.json.gz"))
    assert not eff.has_shapes and all(s.flops is None and s.mfu is None for s in eff.steps)
    assert [round(s.exposed_comm_ms, 1) for s in eff.steps] == [10.2, 10.5, 18.9]
    assert all(0 < s.exposed_comm_ms <= s.comm_ms < s.busy_ms for s in eff.steps)


def test_a_transposed_convolution_as_torch_records_it(tmp_path):
    """A ConvTranspose2d (a GAN generator's layer) profiled forward and backward: torch records it
    as aten::convolution with `transposed` True (and its backward with the same flag), its weight
    (Cin, Cout/groups, kh, kw). Each input element goes into Cout x kh x kw outputs: a stride-2
    layer does stride^2 times the work a plain convolution's formula would give its input."""
    import torch
    from torch import nn

    layer = nn.ConvTranspose2d(64, 32, 4, 2, 1, bias=False)
    x = torch.randn(8, 64, 8, 8, requires_grad=True)
    with torch.profiler.profile(record_shapes=True) as prof:
        layer(x).sum().backward()
    path = tmp_path / "t.json"
    prof.export_chrome_trace(str(path))
    ops = {e["name"]: e["args"] for e in json.loads(path.read_text())["traceEvents"]
           if e.get("name") in ("aten::convolution", "aten::convolution_backward")}
    fwd, bwd = ops["aten::convolution"], ops["aten::convolution_backward"]
    assert fwd["Concrete Inputs"][6] == "True" and bwd["Concrete Inputs"][7] == "True"
    flops = 2 * (8 * 64 * 8 * 8) * (32 * 4 * 4)
    work = op_work("aten::convolution", fwd["Input Dims"], fwd["Input type"], fwd["Concrete Inputs"])
    assert work[0] == flops
    assert work[1] == 4 * (8 * 64 * 8 * 8 + 64 * 32 * 4 * 4 + 8 * 32 * 16 * 16)  # input, weight, the 16x16 output
    assert op_work("aten::convolution_backward", bwd["Input Dims"], bwd["Input type"],
                   bwd["Concrete Inputs"])[0] == 2 * flops
    # an unreadable stride makes the record unreadable, transposed or not
    odd = [*fwd["Concrete Inputs"][:3], "[0, 0]", *fwd["Concrete Inputs"][4:]]
    assert op_work("aten::convolution", fwd["Input Dims"], fwd["Input type"], odd) is None
    # the same layer as a plain convolution's records (no `transposed`): the formula as before
    plain = op_work("aten::convolution", fwd["Input Dims"], fwd["Input type"], fwd["Concrete Inputs"][:6])
    assert plain[0] == 2 * (8 * 64 * 4 * 4) * (32 * 4 * 4)
