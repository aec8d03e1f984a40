"""The allocator replay of a run recorded on a GPU runs on that device's capacity (the run's
environment.cuda_devices: total memory times the per-process fraction), not an assumed card: the
H100 audit of examples/gpu_clean.py printed 'capacity 14.56 GiB assumed: 16 GB T4'."""
from __future__ import annotations

import msgspec
import pytest

from auditor.evidence.allocator.analysis import reports_for
from auditor.evidence.model import Evidence
from auditor.evidence.snapshot import GiB, load_snapshot
from auditor.rules.oom_risk import known_capacities

from conftest import FIXTURES, ROOT

RUN = FIXTURES / "h100" / "audited" / "audited_gpu_clean"
H100_TOTAL = 85017493504  # torch.cuda.get_device_properties(0).total_memory on the recording's H100


def _evidence(fraction: float | None = None) -> Evidence:
    ev = msgspec.json.decode((RUN / "evidence.json").read_bytes(), type=Evidence)
    if fraction is not None:
        ev.environment.cuda_devices[0]["memory_fraction"] = fraction
    ev.__dict__["snapshot_data"] = [load_snapshot(RUN / "memory_snapshot.pickle")]
    return ev


def test_replay_capacity_is_the_recorded_h100s() -> None:
    ev = _evidence()
    assert ev.environment.cuda_devices[0]["total_memory"] == H100_TOTAL
    (r,) = reports_for(ev)
    assert r.capacity_bytes == H100_TOTAL and round(r.capacity_bytes / GiB, 2) == 79.18
    assert r.capacity_source == "from the device: NVIDIA H100 80GB HBM3"


def test_per_process_fraction_caps_the_capacity() -> None:
    ev = _evidence(0.25)
    (r,) = reports_for(ev)
    assert r.capacity_bytes == int(H100_TOTAL * 0.25)
    assert r.capacity_source == "from the device: NVIDIA H100 80GB HBM3, per-process fraction 0.25"
    cap = known_capacities(ev)[0]
    assert cap.total == int(H100_TOTAL * 0.25) and "per-process fraction 0.25" in cap.said


def test_what_if_lines_only_where_the_setting_changes_something() -> None:
    """gpu_clean on the H100 reserved 74 MiB once and kept it: every setting tried replays the same
    peak, allocs and frees. The summary printed five what-if lines saying so; it now names them on
    one line, and keeps a line for a setting that changes something (the churn recording)."""
    from auditor.evidence.load import load_paths
    from auditor.reports.allocator_view import lines

    ev = _evidence()
    what_if = [line for line in lines(ev) if "what if" in line]
    assert what_if == ["  what if expandable_segments:True, max_split_size_mb:128, max_split_size_mb:512, "
                       "garbage_collection_threshold:0.8, roundup_power2_divisions:4: no change (same reserved "
                       "peak, segment allocs, frees, retries and OOMs)"]
    churn = load_paths([ROOT / "tests" / "data" / "allocator_churn.pickle"])
    shown = [line for line in lines(churn) if "what if" in line]
    assert [line.split(":")[0] for line in shown[:-1]] == ["  what if expandable_segments",
                                                           "  what if roundup_power2_divisions"]
    assert "frees 1 -> 0" in shown[0] and "reserved peak 700.0 -> 768.0 MiB" in shown[1]
    assert shown[-1].startswith("  what if max_split_size_mb:128, max_split_size_mb:512, "
                                "garbage_collection_threshold:0.8: no change")
