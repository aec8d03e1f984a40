"""The device model's typical figures against what the recorded fixtures measured: kernel launch
cost, a host sync's round trip on an idle device, and pageable copy bandwidth. Each must agree
within the factor the README states (FACTOR)."""
from __future__ import annotations

import gzip
import json
import re
import statistics

import pytest

from conftest import FIXTURES

from auditor.evidence.devices import match_device

TRACES = FIXTURES / "traces"
FACTOR = 2.5  # the stated factor (README, "GPU costs of rehearsed code")


def _doc(name: str) -> dict:
    with gzip.open(TRACES / f"{name}.pt.trace.json.gz") as f:
        return json.load(f)


def _within(model: float, measured: float) -> bool:
    return 1 / FACTOR <= model / measured <= FACTOR


@pytest.mark.parametrize("name", ["h100_owlv2_syncs_dataloader", "h100_bert_small_item_sync", "a100_item_sync_small",
                                  "a100_ddp_nccl_2rank", "a100_rank0_cpu_item_cudagraphs",
                                  "v100_resnet50_dataloader_workers0"])
def test_launch_cost(name):
    doc = _doc(name)
    row = match_device(doc["deviceProperties"][0])
    durs = [e["dur"] for e in doc["traceEvents"] if e.get("name") in ("cudaLaunchKernel", "cudaLaunchKernelExC")]
    measured = statistics.median(durs)  # 4.0-11 us in these recordings
    assert _within(row.launch_us, measured), (row.launch_us, measured)


@pytest.mark.parametrize("name", ["h100_bert_small_item_sync", "a100_item_sync_small"])
def test_sync_round_trip_on_an_idle_device(name):
    """The `.item()` fixtures: a one-value copy and its cudaStreamSynchronize, 6-8 us."""
    doc = _doc(name)
    row = match_device(doc["deviceProperties"][0])
    durs = [e["dur"] for e in doc["traceEvents"] if e.get("name") == "cudaStreamSynchronize"]
    assert _within(row.sync_us, min(durs)), (row.sync_us, min(durs))


@pytest.mark.parametrize("name,pattern", [
    ("h100_owlv2_syncs_dataloader", r"HtoD"),  # 18.7 GB/s against the H100 row's 20
    ("h100_owlv2_syncs_dataloader", r"DtoH"),  # 11.4 GB/s
    ("v100_resnet50_dataloader_workers0", r"HtoD"),  # 10.1 GB/s against the V100 row's 6
])
def test_pageable_copy_bandwidth(name, pattern):
    doc = _doc(name)
    row = match_device(doc["deviceProperties"][0])
    copies = [e for e in doc["traceEvents"] if e.get("cat") in ("gpu_memcpy", "Memcpy") and re.search(pattern, e["name"])
              and (e.get("args", {}).get("bytes") or 0) >= 1 << 20 and e.get("dur", 0) > 0]
    assert copies
    gbps = sum(e["args"]["bytes"] for e in copies) / sum(e["dur"] for e in copies) / 1e3
    assert _within(row.pcie_pageable_gbs, gbps), (row.pcie_pageable_gbs, gbps)
