"""What a step's record says of memory at its end (auditor.capture.session): the CUDA allocator's
allocated and reserved bytes, read once from its nested stats, are the figures torch's own
memory_allocated() and memory_reserved() give for the same allocator state."""
from __future__ import annotations

import torch

from auditor.capture import session


def nested_stats() -> dict:
    """The shape of torch._C._cuda_memoryStats(device): every stat of c10's DeviceStats, by pool."""
    pools = ("all", "small_pool", "large_pool")
    stats: dict = {k: 0 for k in ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
                                   "num_device_free", "max_split_size")}
    for n, k in enumerate(("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
                           "active_bytes", "inactive_split_bytes", "requested_bytes")):
        stats[k] = {p: {"current": 1000 * n + 10 * i + 1, "peak": 1000 * n + 10 * i + 2, "allocated": 7, "freed": 6}
                    for i, p in enumerate(pools)}
    stats["oversize_allocations"] = stats["oversize_segments"] = {"current": 0, "peak": 0, "allocated": 0, "freed": 0}
    return stats


def test_the_step_records_the_allocators_bytes_as_torch_reports_them(monkeypatch):
    stats = nested_stats()
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", lambda device: stats, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_get_device_index", lambda device, optional=False: 0)
    expected = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
    assert expected == (4001, 5001)  # (allocated_bytes.all.current, reserved_bytes.all.current)
    assert session.device_memory() == expected


def test_a_process_without_cuda_records_no_device_memory():
    assert not torch.cuda.is_initialized()
    assert session.device_memory() == (None, None)
