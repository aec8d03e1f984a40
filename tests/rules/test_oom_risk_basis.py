"""oom-risk's near-capacity finding on the recorded snapshots: one basis for every allocated figure,
and missing evidence values shown as missing in report.html (not as Python's "None").

The allocator's history records requested bytes; the snapshot's state also has the blocks those
requests were rounded up to. The transformer fixture is the trap: its replayed peak (requested,
51.04 GiB) is below its live blocks at the end (51.11 GiB), so a peak in one basis set against a
"now" in the other reads as a peak below the present. Expected numbers are computed here from the
raw pickle dicts (read with the project's global-refusing unpickler), not taken from the rule.
"""
from __future__ import annotations

import html as html_lib
import io
import re
from pathlib import Path

import pytest

from conftest import FIXTURES, audit

from auditor.evidence.load import load_paths
from auditor.evidence.snapshot import _SafeUnpickler, format_bytes
from auditor.findings import Finding
from auditor.rules.oom_risk import OomRisk

SNAPSHOTS = FIXTURES / "snapshots"
FRAGMENTED = SNAPSHOTS / "fragmented_72gb_state_only.pickle"
TRANSFORMER = SNAPSHOTS / "transformer_fullstep_with_history.pickle"



def raw(path: Path) -> dict:
    return _SafeUnpickler(io.BytesIO(path.read_bytes())).load()


def blocks(d: dict) -> list[dict]:
    return [b for s in d["segments"] for b in s["blocks"]]


def live_requested(d: dict) -> int:
    """Requested bytes of every occupied block (allocated, or freed but awaiting another stream)."""
    return sum(b["requested_size"] for b in blocks(d) if b["state"] != "inactive")


def allocated_blocks(d: dict) -> int:
    """Block bytes of allocated blocks: torch.cuda.memory_allocated's figure."""
    return sum(b["size"] for b in blocks(d) if b["state"] == "active_allocated")


def replayed_peak(d: dict) -> tuple[int, int]:
    """(peak requested bytes, its trace index) by prefix sums from the end state backwards."""
    trace = d["device_traces"][0]
    delta = [e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
             for e in trace]
    cur = live_requested(d) - sum(delta)
    best, best_i = cur, -1
    for i, x in enumerate(delta):
        cur += x
        if cur > best:
            best, best_i = cur, i
    return best, best_i


def near_capacity(path: Path, capacity_gib: float) -> Finding:
    opts = OomRisk.options_with({"device-capacity-gib": capacity_gib, "top-owners": 100})
    [f] = OomRisk().check(load_paths([path]), opts)
    return f


def test_history_peak_and_the_snapshot_moment_share_the_requested_basis() -> None:
    d = raw(TRANSFORMER)
    peak, peak_i = replayed_peak(d)
    now = live_requested(d)
    assert now <= peak < allocated_blocks(d)  # the trap: block bytes now exceed the requested peak

    f = near_capacity(TRANSFORMER, 60.0)
    e = f.evidence
    assert e["allocated_basis"] == "requested"
    assert (e["peak_allocated"], e["peak_index"], e["allocated_now"]) == (peak, peak_i, now)
    assert e["peak_allocated"] >= e["allocated_now"]
    assert sum(o["bytes"] for o in e["owners"]) == peak
    reserved_then = sum(s["total_size"] for s in d["segments"])  # no segment changes after the peak here
    assert e["reserved_unallocated"] == reserved_then - peak
    assert (f"allocations peaked at {format_bytes(peak)} at event {peak_i + 1:,} of {len(d['device_traces'][0]):,}"
            in f.message)
    assert f"held {format_bytes(now)} when the snapshot was taken" in f.message
    assert "requested bytes" in f.message
    assert format_bytes(allocated_blocks(d)) not in f.message  # no block-basis figure beside them


def test_state_only_snapshot_reports_requested_bytes_as_its_owners_do() -> None:
    d = raw(FRAGMENTED)
    now, reserved = live_requested(d), sum(s["total_size"] for s in d["segments"])
    assert now != allocated_blocks(d)

    f = near_capacity(FRAGMENTED, 60.0)
    e = f.evidence
    assert e["allocated_basis"] == "requested"
    assert e["peak_allocated"] == e["allocated_now"] == now == sum(o["bytes"] for o in e["owners"])
    assert e["peak_index"] is None and e["peak_reserved"] == reserved
    assert e["reserved_unallocated"] == reserved - now
    assert f"allocations held {format_bytes(now)} at the snapshot" in f.message and "requested bytes" in f.message
    assert format_bytes(allocated_blocks(d)) not in f.message
    assert f"the {format_bytes(reserved - now)} reserved but not allocated at the peak" in f.fix.summary


# ------------------------------------------------------------------------------------------------
# report.html, through the real CLI


def evidence_rows(report: str) -> list[dict[str, str]]:
    """Each finding's Evidence table as {key: visible text}, scripts and tags stripped (the key is
    the row's title: its label is the key in words)."""
    body = re.sub(r"<script\b.*?</script>", "", report, flags=re.S | re.I)
    tables = re.findall(r"<summary>Evidence</summary>\s*<table class=\"kv\">(.*?)</table>", body, flags=re.S)
    text = lambda s: html_lib.unescape(re.sub(r"<[^>]+>", "", s)).strip()  # noqa: E731
    return [{text(key or label): text(v)
             for key, label, v in re.findall(r"<tr><th(?: title=\"(.*?)\")?>(.*?)</th><td>(.*?)</td></tr>", t, flags=re.S)}
            for t in tables]


def test_missing_evidence_values_are_not_shown_as_none(tmp_path: Path) -> None:
    """A state-only snapshot judged against the option: no file the capacity came from, no peak
    index or time. findings.json keeps them null; the report shows them as missing."""
    (tmp_path / "pyproject.toml").write_text("[tool.auditor]\n[tool.auditor.rules.oom-risk]\n"
                                             "device-capacity-gib = 60.0\n")
    a = audit("analyze", str(FRAGMENTED), "--select", "oom-risk", out=tmp_path / "out", cwd=tmp_path)
    assert a.returncode == 0, a.stderr
    [f] = a.rule("oom-risk")
    missing = [k for k, v in f["evidence"].items() if v is None]
    assert set(missing) >= {"capacity_from", "peak_index", "peak_time_us"}

    report = (a.out / "report.html").read_text()
    [rows] = evidence_rows(report)
    assert set(rows) == set(f["evidence"])
    assert {k: rows[k] for k in missing} == dict.fromkeys(missing, "-")
    assert "None" not in rows.values()
    assert rows["capacity_source"] == "device-capacity-gib" and rows["device"] == "0"
    assert rows["peak_reserved"] == str(f["evidence"]["peak_reserved"])
