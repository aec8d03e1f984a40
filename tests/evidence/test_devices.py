"""The device model: every row typed and sourced, the recorded traces' deviceProperties pick the
right row, `--device` picks one by name, and an unknown name is one clear error line."""
from __future__ import annotations

import gzip
import json

import msgspec
import pytest

from conftest import FIXTURES, audit
from test_usage_errors import one_line_error

from auditor.evidence.devices import DEFAULT_DEVICE, DEVICES, DeviceSpec, find_device, match_device

TRACES = FIXTURES / "traces"


def _props(name: str) -> dict:
    with gzip.open(TRACES / name) as f:
        return json.load(f)["deviceProperties"][0]


def test_every_row_is_complete_and_sourced():
    keys = [d.key for d in DEVICES]
    assert len(keys) == len(set(keys))
    for d in DEVICES:
        assert isinstance(d, DeviceSpec)
        msgspec.convert(msgspec.to_builtins(d), DeviceSpec)  # a typed row
        assert d.source.startswith("https://"), d.key
        assert d.fp32 > 0 and d.bf16 >= d.fp32 and d.mem_bw_gbs > 0
        assert d.pcie_pinned_gbs > d.pcie_pageable_gbs > 0 and d.launch_us > 0 and d.sync_us > 0
    for wanted in ("a100-sxm4-40gb", "a100-sxm4-80gb", "a100-pcie-40gb", "a100-pcie-80gb", "h100-sxm",
                   "h100-pcie", "h200", "b200", "l4", "l40s", "a10g", "v100-sxm2", "t4", "rtx3090",
                   "rtx4090", "mi250x", "mi300x"):
        assert wanted in keys
    assert find_device(DEFAULT_DEVICE) is not None


@pytest.mark.parametrize("fixture,key", [
    ("h100_owlv2_syncs_dataloader.pt.trace.json.gz", "h100-sxm"),  # NVIDIA H100 80GB HBM3, 132 SMs
    ("a100_rank0_cpu_item_cudagraphs.pt.trace.json.gz", "a100-sxm4-80gb"),  # NVIDIA A100-SXM4-80GB
    ("a100_ddp_nccl_2rank.pt.trace.json.gz", "a100-sxm4-40gb"),  # NVIDIA A100-PG509-200, 39.4 GiB
    ("v100_resnet50_dataloader_workers0.pt.trace.json.gz", "v100-sxm2"),  # Tesla V100-DGXS-32GB
])
def test_recorded_device_properties_pick_the_row(fixture, key):
    assert match_device(_props(fixture)).key == key


@pytest.mark.parametrize("props,key", [
    ({"name": "NVIDIA A100-PCIE-40GB", "numSms": 108, "totalGlobalMem": 42505273344}, "a100-pcie-40gb"),
    ({"name": "NVIDIA A100 80GB PCIe", "numSms": 108, "totalGlobalMem": 85095874560}, "a100-pcie-80gb"),
    ({"name": "NVIDIA H100 PCIe", "numSms": 114, "totalGlobalMem": 85029158912}, "h100-pcie"),
    ({"name": "NVIDIA L4"}, "l4"), ({"name": "NVIDIA L40S"}, "l40s"), ({"name": "NVIDIA A10G"}, "a10g"),
    ({"name": "Tesla T4"}, "t4"), ({"name": "Tesla V100-PCIE-32GB"}, "v100-pcie"),
    ({"name": "NVIDIA GeForce RTX 4090"}, "rtx4090"), ({"name": "NVIDIA GeForce RTX 3090"}, "rtx3090"),
    ({"name": "AMD Instinct MI250X", "numSms": 110}, "mi250x"), ({"name": "AMD Instinct MI300X"}, "mi300x"),
    ({"name": "NVIDIA H200"}, "h200"), ({"name": "NVIDIA B200"}, "b200"),
])
def test_names_torch_reports(props, key):
    assert match_device(props).key == key


def test_unknown_devices_match_nothing():
    assert match_device({"name": "NVIDIA GeForce GTX 1080"}) is None
    assert match_device({}) is None
    assert find_device("tpu-v5") is None


def test_find_device_by_key_display_name_or_torch_name():
    assert find_device("H100-SXM").key == "h100-sxm"
    assert find_device("NVIDIA A100 SXM4 80GB").key == "a100-sxm4-80gb"
    assert find_device("NVIDIA H100 80GB HBM3").key == "h100-sxm"


def test_peaks_by_dtype():
    a100 = find_device("a100-sxm4-80gb")
    assert a100.peak_tflops("float32") == 19.5 and a100.peak_tflops("tf32") == 156
    assert a100.peak_tflops("c10::BFloat16") == 312 and a100.peak_tflops("c10::Half") == 312
    assert find_device("v100-sxm2").peak_tflops("tf32") == 15.7  # no TF32 path: fp32's rate
    assert a100.ridge == pytest.approx(312e12 / 2039e9)


def test_unknown_device_option_is_one_error_line(tmp_path):
    a = audit("analyze", str(TRACES / "a100_item_sync_small.pt.trace.json.gz"), "--device", "tpu-v5",
              out=tmp_path / "o")
    one_line_error(a, "--device 'tpu-v5': not a known device; known: a100-sxm4-40gb")
    assert "mi300x" in a.stderr


def test_device_option_is_recorded_for_the_rules(tmp_path):
    a = audit("analyze", str(TRACES / "a100_item_sync_small.pt.trace.json.gz"), "--device", "H100 SXM",
              "-q", out=tmp_path / "o")
    assert a.returncode in (0, 1), a.stderr
    assert a.evidence["environment"]["device_model"] == "h100-sxm"
