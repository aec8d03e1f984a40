"""The device model: what common accelerators can do at most, for judging what a trace shows.

One typed row (DeviceSpec) per accelerator: peak dense TFLOP/s per dtype, memory bandwidth, the
host link (PCIe, pinned and pageable), the GPU-to-GPU link, and the launch and synchronisation
latencies. Each figure's public source is named in a comment by its row; vendor figures are
datasheet or whitepaper numbers (dense, i.e. without 2:4 structured sparsity; boost clock). The
host-link and latency figures are not vendor-stated: they are typical measured values (see
_LINK and _LATENCY below for their basis), and the report says so when it uses them.

`match_device(props)` picks the row for a trace's `deviceProperties` entry (name, SM count, memory);
`find_device(name)` the row the user named with `--device`; `device_for(trace, chosen)` the row a
rule uses (the trace's own first, then `--device`).
"""
from __future__ import annotations

import re
from typing import Any

import msgspec

GIB = 1024 ** 3


class DeviceSpec(msgspec.Struct, frozen=True):
    """One accelerator as the device model knows it (one PyTorch device: for the MI250X, one of
    its two dies, as ROCm shows it).

    key: the `--device` name (`a100-sxm4-80gb`); name: how the report names it; vendor: nvidia |
    amd; family: a regex on the device name torch reports (`deviceProperties[].name`) that every
    variant of the product matches; variant: a regex that picks this row among the family's (empty:
    none needed); sms: streaming multiprocessors (compute units on AMD); memory_gb: memory as sold
    (GB). Peaks in TFLOP/s, dense: fp32 (vector, or FP32 matrix cores where the vendor states a
    dense FP32 matrix rate: AMD), tf32 (None where the hardware has no TF32 path: matmuls in fp32
    then run at `fp32`), fp16 and bf16 (tensor/matrix cores, fp32 accumulate), fp8 (None where it
    does not exist). mem_bw_gbs: memory bandwidth, GB/s. pcie_pinned_gbs / pcie_pageable_gbs: a
    host<->device copy's typical achieved bandwidth per direction from pinned and from pageable
    host memory, GB/s. nvlink_gbs: GPU-to-GPU link bandwidth, total of both directions, GB/s (None
    when none). launch_us: the host's cost of one kernel launch; sync_us: the round trip of one
    host synchronisation on an idle device (both typical, microseconds). source: the vendor document
    the peak and memory figures come from.
    """

    key: str
    name: str
    vendor: str
    family: str
    variant: str
    sms: int
    memory_gb: float
    fp32: float
    tf32: float | None
    fp16: float
    bf16: float
    fp8: float | None
    mem_bw_gbs: float
    pcie_pinned_gbs: float
    pcie_pageable_gbs: float
    nvlink_gbs: float | None
    launch_us: float
    sync_us: float
    source: str

    def peak_tflops(self, dtype: str) -> float:
        """Peak dense TFLOP/s of a matmul in `dtype` (float32 | tf32 | float16 | bfloat16 | fp8):
        fp32 without TF32 (the PyTorch default for matmuls), tf32 where the hardware has it."""
        d = dtype.lower()
        if d in ("tf32",):
            return self.tf32 if self.tf32 is not None else self.fp32
        if d in ("float16", "half", "fp16", "c10::half"):
            return self.fp16
        if d in ("bfloat16", "bf16", "c10::bfloat16"):
            return self.bf16
        if d.startswith("fp8") or d.startswith("float8") or d.startswith("c10::float8"):
            return self.fp8 if self.fp8 is not None else self.fp16
        return self.fp32

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (FLOP per byte of memory traffic) above which a bf16 kernel is
        bound by compute rather than by memory: the roofline's ridge point."""
        return self.bf16 * 1e12 / (self.mem_bw_gbs * 1e9)

    def ridge_for(self, dtype: str) -> float:
        return self.peak_tflops(dtype) * 1e12 / (self.mem_bw_gbs * 1e9)


# Host link, per direction, typical achieved (not vendor-stated). The vendor rates are the PCIe
# specification's x16 figures: Gen3 15.75 GB/s, Gen4 31.5 GB/s, Gen5 63 GB/s per direction
# (PCI-SIG, quoted in every datasheet below as 32 / 64 / 128 GB/s bidirectional). Pinned copies reach
# ~80% of that in CUDA's bandwidthTest / nvbandwidth (NVIDIA cuda-samples, github.com/NVIDIA/nvbandwidth);
# pageable copies go through the driver's staging buffer and a host memcpy, typically a third to a
# half of pinned (NVIDIA CUDA C++ Best Practices Guide, "Pinned Memory"; NVIDIA developer forum
# thread 188328 on the staging buffer); taken here as 40-50% of pinned. The recorded fixtures agree
# within 2x (README, "GPU costs of rehearsed code"; tests/evidence/test_device_vs_recordings.py).
_LINK = {  # generation: (pinned, pageable) GB/s per direction
    3: (12.0, 6.0),
    4: (25.0, 10.0),
    5: (50.0, 20.0),
}
# Latencies, typical (not vendor-stated): a kernel launch costs the host ~5 us through PyTorch's
# eager dispatch plus cudaLaunchKernel (the "launch overhead" of the PyTorch blog "Accelerating
# PyTorch with CUDA Graphs", 2021, and NVIDIA's "Getting Started with CUDA Graphs": a few us per
# launch); hipLaunchKernel on ROCm ~7 us. A host synchronisation on an idle device
# (cudaStreamSynchronize / .item() round trip) ~10 us: the call itself (6-8 us in the public H100 and
# A100 recordings of HolisticTraceAnalysis and TraceLens, tests/fixtures/traces) and the relaunch of
# the emptied queue after it; ~15 us on ROCm.
_LATENCY = {"nvidia": (5.0, 10.0), "amd": (7.0, 15.0)}


def _row(key: str, name: str, vendor: str, family: str, variant: str, sms: int, memory_gb: float,
         fp32: float, tf32: float | None, fp16: float, bf16: float, fp8: float | None, mem_bw_gbs: float,
         pcie_gen: int, nvlink_gbs: float | None, source: str) -> DeviceSpec:
    pinned, pageable = _LINK[pcie_gen]
    launch, sync = _LATENCY[vendor]
    return DeviceSpec(key=key, name=name, vendor=vendor, family=family, variant=variant, sms=sms,
                      memory_gb=memory_gb, fp32=fp32, tf32=tf32, fp16=fp16, bf16=bf16, fp8=fp8,
                      mem_bw_gbs=mem_bw_gbs, pcie_pinned_gbs=pinned, pcie_pageable_gbs=pageable,
                      nvlink_gbs=nvlink_gbs, launch_us=launch, sync_us=sync, source=source)


_A100 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
_H100 = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_H200 = "https://www.nvidia.com/en-us/data-center/h200/"
_B200 = "https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200 specifications, per GPU = 1/8)"
_L4 = "https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet"
_L40S = "https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413"
_A10 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/a10-datasheet.pdf"
_V100 = "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf"
_T4 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf"
_GA102 = "https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf"
_AD102 = "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"
_MI250X = "https://www.amd.com/en/products/accelerators/instinct/mi200/mi250x.html"
_MI300X = "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html"

_NO_PCIE = r"^(?!.*PCI)"  # an SXM part: torch names it without `PCIe` (e.g. NVIDIA A100-PG509-200)

DEVICES: tuple[DeviceSpec, ...] = (
    # A100 datasheet (r4): FP32 19.5, TF32 156, BF16/FP16 312 (dense; 312/624 are the sparse
    # figures), no FP8; memory 1,555 GB/s (40GB), 2,039 GB/s (80GB SXM), 1,935 GB/s (80GB PCIe);
    # NVLink 600 GB/s (SXM; PCIe with a bridge: 600 GB/s too); PCIe Gen4 64 GB/s.
    _row("a100-sxm4-40gb", "NVIDIA A100 SXM4 40GB", "nvidia", r"A100", _NO_PCIE, 108, 40,
         19.5, 156, 312, 312, None, 1555, 4, 600, _A100),
    _row("a100-sxm4-80gb", "NVIDIA A100 SXM4 80GB", "nvidia", r"A100", _NO_PCIE, 108, 80,
         19.5, 156, 312, 312, None, 2039, 4, 600, _A100),
    _row("a100-pcie-40gb", "NVIDIA A100 PCIe 40GB", "nvidia", r"A100", r"PCI", 108, 40,
         19.5, 156, 312, 312, None, 1555, 4, 600, _A100),
    _row("a100-pcie-80gb", "NVIDIA A100 PCIe 80GB", "nvidia", r"A100", r"PCI", 108, 80,
         19.5, 156, 312, 312, None, 1935, 4, 600, _A100),
    # H100 datasheet: SXM FP32 67, TF32 989 / BF16 1,979 / FP8 3,958 "with sparsity" (dense is half:
    # 494.5 / 989.5 / 1,979), 3.35 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s; PCIe card (114 SMs):
    # FP32 51, TF32 756 / BF16 1,513 / FP8 3,026 sparse (378 / 756.5 / 1,513 dense), 2 TB/s,
    # NVLink bridge 600 GB/s.
    _row("h100-sxm", "NVIDIA H100 SXM 80GB", "nvidia", r"H100", r"HBM3|SXM|^(?!.*(PCI|NVL))", 132, 80,
         67, 494.5, 989.5, 989.5, 1979, 3350, 5, 900, _H100),
    _row("h100-pcie", "NVIDIA H100 PCIe 80GB", "nvidia", r"H100", r"PCI", 114, 80,
         51, 378, 756.5, 756.5, 1513, 2000, 5, 600, _H100),
    # H200 product page: same Tensor Core figures as H100 SXM (sparse 989 / 1,979 / 3,958), 141 GB
    # HBM3e at 4.8 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s.
    _row("h200", "NVIDIA H200 141GB", "nvidia", r"H200", "", 132, 141,
         67, 494.5, 989.5, 989.5, 1979, 4800, 5, 900, _H200),
    # HGX B200 (8 GPUs): FP8 72 PF, FP16/BF16 36 PF, TF32 18 PF (sparse), FP32 600 TF, 1,440 GB
    # memory at 64 TB/s, NVLink 1.8 TB/s per GPU -> per GPU dense: FP8 4,500, BF16 2,250, TF32 1,125,
    # FP32 75; 180 GB at 8 TB/s; host link PCIe Gen5.
    _row("b200", "NVIDIA B200 180GB", "nvidia", r"B200", "", 148, 180,
         75, 1125, 2250, 2250, 4500, 8000, 5, 1800, _B200),
    # L4 datasheet: FP32 30.3, TF32 120 / BF16 242 / FP8 485 sparse (60 / 121 / 242.5 dense),
    # 24 GB at 300 GB/s, PCIe Gen4 x16, no NVLink.
    _row("l4", "NVIDIA L4 24GB", "nvidia", r"\bL4\b", "", 58, 24,
         30.3, 60, 121, 121, 242.5, 300, 4, None, _L4),
    # L40S datasheet: FP32 91.6, TF32 366 / BF16 733 / FP8 1,466 sparse (183 / 366 / 733 dense),
    # 48 GB at 864 GB/s, PCIe Gen4 x16, no NVLink.
    _row("l40s", "NVIDIA L40S 48GB", "nvidia", r"L40S", "", 142, 48,
         91.6, 183, 366, 366, 733, 864, 4, None, _L40S),
    # A10 datasheet (the A10G of AWS g5 instances is its cloud variant; NVIDIA publishes no A10G
    # sheet, so the A10's figures stand for it): FP32 31.2, TF32 62.5, BF16/FP16 125 (dense),
    # 24 GB at 600 GB/s, PCIe Gen4.
    _row("a10g", "NVIDIA A10G / A10 24GB", "nvidia", r"\bA10G?\b", "", 80, 24,
         31.2, 62.5, 125, 125, None, 600, 4, None, _A10),
    # V100 datasheet: SXM2 FP32 15.7, Tensor (FP16) 125, 900 GB/s, NVLink 300 GB/s, PCIe Gen3
    # 32 GB/s; PCIe card FP32 14, Tensor 112, 900 GB/s. No TF32, no BF16 (bf16 runs without tensor
    # cores: taken at the FP32 rate).
    _row("v100-sxm2", "NVIDIA V100 SXM2", "nvidia", r"V100", _NO_PCIE, 80, 32,
         15.7, None, 125, 15.7, None, 900, 3, 300, _V100),
    _row("v100-pcie", "NVIDIA V100 PCIe", "nvidia", r"V100", r"PCI", 80, 32,
         14, None, 112, 14, None, 900, 3, None, _V100),
    # T4 datasheet: FP32 8.1, mixed precision (FP16/FP32) 65, 16 GB at 320 GB/s, PCIe Gen3 x16.
    _row("t4", "NVIDIA T4 16GB", "nvidia", r"\bT4\b", "", 40, 16,
         8.1, None, 65, 8.1, None, 320, 3, None, _T4),
    # GA102 whitepaper (GeForce RTX 3090): FP32 35.6, FP16/BF16 tensor with FP32 accumulate 71
    # (dense), TF32 35.6, 24 GB GDDR6X at 936 GB/s, PCIe Gen4.
    _row("rtx3090", "NVIDIA GeForce RTX 3090", "nvidia", r"RTX 3090", "", 82, 24,
         35.6, 35.6, 71, 71, None, 936, 4, None, _GA102),
    # Ada whitepaper (GeForce RTX 4090): FP32 82.6, TF32 82.6, FP16/BF16 with FP32 accumulate
    # 165.2, FP8 with FP32 accumulate 330.3 (dense), 24 GB GDDR6X at 1,008 GB/s, PCIe Gen4.
    _row("rtx4090", "NVIDIA GeForce RTX 4090", "nvidia", r"RTX 4090", "", 128, 24,
         82.6, 82.6, 165.2, 165.2, 330.3, 1008, 4, None, _AD102),
    # MI250X product page (the whole OAM module: two dies): FP32 matrix 95.7, FP16/BF16 383,
    # 128 GB HBM2e at 3.2768 TB/s, Infinity Fabric 800 GB/s (8 links), PCIe Gen4. ROCm shows each die
    # as one device (110 CUs, 64 GB): the row is half the module. No TF32, no FP8.
    _row("mi250x", "AMD Instinct MI250X (one die)", "amd", r"MI250", "", 110, 64,
         47.85, None, 191.5, 191.5, None, 1638.4, 4, 400, _MI250X),
    # MI300X product page: FP32 matrix 163.4, TF32 653.7, FP16/BF16 1,307.4, FP8 2,614.9 (dense),
    # 192 GB HBM3 at 5.3 TB/s, Infinity Fabric 896 GB/s, PCIe Gen5 x16 128 GB/s.
    _row("mi300x", "AMD Instinct MI300X", "amd", r"MI300X?", "", 304, 192,
         163.4, 653.7, 1307.4, 1307.4, 2614.9, 5300, 5, 896, _MI300X),
)

# The row a rehearsed run (CUDA code run on the CPU) is estimated on when `--device` names none: the
# most common training GPU in clouds and clusters.
DEFAULT_DEVICE = "a100-sxm4-80gb"


def _norm(text: str) -> str:
    return re.sub(r"[\s_\-/]+", "", text).lower()


def known_names() -> list[str]:
    return [d.key for d in DEVICES]


def find_device(name: str) -> DeviceSpec | None:
    """The row `--device NAME` names: its key or display name (case, spaces, dashes and
    underscores ignored), or a device name as torch reports it (`NVIDIA H100 80GB HBM3`)."""
    wanted = _norm(name)
    if not wanted:
        return None
    for d in DEVICES:
        if wanted in (_norm(d.key), _norm(d.name)):
            return d
    return match_device({"name": name})


def match_device(props: dict[str, Any]) -> DeviceSpec | None:
    """The row for one `deviceProperties` entry of a trace (or torch.cuda.get_device_properties as
    a dict): its name picks the product family; among the family's rows the one whose variant
    regex matches the name, then whose SM count equals `numSms` (`multi_processor_count`), then
    whose memory is nearest `totalGlobalMem` (`total_memory`). None for a device not in the table."""
    name = str(props.get("name") or "")
    if not name:
        return None
    family = [d for d in DEVICES if re.search(d.family, name, re.IGNORECASE)]
    if not family:
        return None
    sms = props.get("numSms", props.get("multi_processor_count"))
    memory = props.get("totalGlobalMem", props.get("total_memory"))
    gib = float(memory) / GIB if isinstance(memory, (int, float)) and memory > 0 else None

    def score(d: DeviceSpec) -> tuple[int, int, float]:
        variant = int(bool(d.variant) and re.search(d.variant, name, re.IGNORECASE) is not None)
        same_sms = int(isinstance(sms, int) and sms == d.sms)
        distance = abs(gib - d.memory_gb) if gib is not None else 0.0
        return (variant, same_sms, -distance)

    return max(family, key=score)


def trace_device(trace: Any, index: int | None = None) -> DeviceSpec | None:
    """The row for a trace's GPU, matched from its deviceProperties: device `index`, else the
    first listed (a trace lists every visible GPU, all of one kind in the recordings seen)."""
    props = getattr(trace, "device_properties", [])
    if not props:
        return None
    chosen = None
    if index is not None:
        chosen = next((p for p in props if p.get("id") == index), None)
    return match_device(chosen or props[0])


def device_for(trace: Any = None, chosen: str = "", index: int | None = None) -> tuple[DeviceSpec | None, str]:
    """The row a rule judges a trace by, and where it came from (said in the report): the trace's
    own deviceProperties when they name a known device, else the one `--device` chose (`chosen`,
    a key: Environment.device_model), else (None, why)."""
    if trace is not None:
        found = trace_device(trace, index)
        if found is not None:
            return found, "the trace's deviceProperties"
    if chosen:
        found = find_device(chosen)
        if found is not None:
            return found, "--device"
    names = sorted({str(p.get("name")) for p in getattr(trace, "device_properties", []) if p.get("name")})
    if names:
        return None, f"{', '.join(names)} is not in the device table (choose one with --device)"
    return None, "the trace names no device (choose one with --device)"


def unknown_device_message(name: str) -> str:
    """The one error line for `--device NAME` naming no known device."""
    return f"--device {name!r}: not a known device; known: {', '.join(known_names())}"
