"""`audit analyze` end to end, through the real CLI (`python -m auditor analyze PATH --out DIR`) on the
recorded GPU fixtures, and bad inputs given to it.

Every expected number is recomputed here from the raw fixture (gzip + json for traces, a restricted
unpickler of the test's own for the snapshot), never through the auditor's parsers. Each fixture is
analyzed once per module and the result shared.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import random
import re
import shlex
import statistics
from functools import cache
from pathlib import Path

import pytest

from conftest import FIXTURES, Audit, audit

TRACES = FIXTURES / "traces"
SNAPSHOTS = FIXTURES / "snapshots"
W0 = TRACES / "v100_resnet50_dataloader_workers0.pt.trace.json.gz"
W4 = TRACES / "v100_resnet50_dataloader_workers4.pt.trace.json.gz"
RANK0 = TRACES / "a100_rank0_cpu_item_cudagraphs.pt.trace.json.gz"
SMALL = TRACES / "a100_item_sync_small.pt.trace.json.gz"
FRAGMENTED = SNAPSHOTS / "fragmented_72gb_state_only.pickle"
GiB, MiB = 1 << 30, 1 << 20


SEVERITIES = {"info", "warning", "error"}
# The findings.json contract (README, "findings.json"): keys that must be there.
TOP_KEYS = {"tool", "target", "source", "run_time", "environment", "steps", "ending", "findings", "skipped_rules", "rule_errors",
            "suppressed", "baseline", "allocator"}
ENV_KEYS = {"torch_version", "python_version", "platform", "hostname", "device", "cuda_available", "cuda_standins", "device_model",
            "rehearsal", "num_threads", "env_vars", "backend_flags", "notes"}
STEPS_KEYS = {"count", "requested", "per_step_ms", "median_ms", "numerics_check_median_ms", "total_ms",
              "profiled_steps", "gpu"}
FINDING_KEYS = {"rule", "severity", "title", "message", "locations", "evidence", "cost", "fix"}
COST_KEYS = {"ms_per_step", "share_of_step", "measured", "note"}
FIX_KEYS = {"summary", "config", "patch", "edits", "changes_numerics", "verified"}


# ------------------------------------------------------------------------------------------------
# Raw fixtures, read without the auditor


@cache
def raw(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def raw_steps(path: Path) -> list[tuple[float, float]]:
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in raw(path) if e.get("ph") == "X"
                  and str(e.get("name", "")).startswith("ProfilerStep#")
                  and e.get("cat") in ("user_annotation", "Operator"))


def raw_loader_ms(path: Path) -> list[float]:
    """Per ProfilerStep: microseconds inside `enumerate(DataLoader)#...__next__`."""
    loader = [(e["ts"], e["ts"] + e["dur"]) for e in raw(path)
              if e.get("ph") == "X" and re.fullmatch(r"enumerate\(DataLoader\)#.*__next__", e.get("name", ""))]
    assert loader
    return [sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in loader) for lo, hi in raw_steps(path)]


class NoGlobals(pickle.Unpickler):
    """A memory snapshot is plain dicts, lists, ints and strings: any global is refused."""

    def find_class(self, module: str, name: str):  # noqa: ANN201
        raise pickle.UnpicklingError(f"global {module}.{name} refused")


@cache
def raw_snapshot(path: Path) -> dict:
    return NoGlobals(io.BytesIO(path.read_bytes())).load()


# ------------------------------------------------------------------------------------------------
# One `audit analyze` per fixture for the whole module


@pytest.fixture(scope="module")
def analyzed(tmp_path_factory: pytest.TempPathFactory):
    runs: dict[Path, Audit] = {}

    def get(path: Path) -> Audit:
        if path not in runs:
            out = tmp_path_factory.mktemp("analyze") / "out"
            runs[path] = audit("analyze", str(path), "--quiet", out=out)
        return runs[path]

    return get


def check_contract(a: Audit) -> dict:
    """Exit 0, one summary line, and findings.json / report.html / findings.sarif as documented."""
    assert a.returncode == 0, a.stderr
    assert "Traceback" not in a.stdout + a.stderr
    doc = a.findings_doc
    assert TOP_KEYS <= set(doc)
    assert doc["tool"]["name"] == "auditor" and doc["tool"]["version"]
    assert isinstance(doc["target"], str)
    assert ENV_KEYS <= set(doc["environment"]) and STEPS_KEYS <= set(doc["steps"])
    assert doc["rule_errors"] == []  # no rule crashed on a real recording
    assert doc["findings"], "every fixture used here has at least one finding"
    for f in doc["findings"]:
        assert FINDING_KEYS <= set(f), f["rule"]
        assert f["severity"] in SEVERITIES and f["title"] and f["message"]
        assert isinstance(f["evidence"], dict) and f["evidence"]
        for loc in f["locations"]:
            assert {"file", "line", "code"} <= set(loc) and isinstance(loc["line"], int)
        assert f["cost"] is None or COST_KEYS <= set(f["cost"])
        if f["cost"] and f["cost"]["ms_per_step"] is not None and doc["run_time"]:
            # one definition of a cost's share, whichever rule: of the run's time per step findings.json states
            assert f["cost"]["share_of_step"] == round(f["cost"]["ms_per_step"] / doc["run_time"]["base_ms"], 4), f["rule"]
        assert FIX_KEYS <= set(f["fix"]) and f["fix"]["summary"]
    ran = {f["rule"] for f in doc["findings"]}
    assert not ran & {s["rule"] for s in doc["skipped_rules"]}  # a rule either ran or was skipped
    assert a.stdout.strip().splitlines() == [f"audit: {len(doc['findings'])} finding(s); report in {a.out}"]
    html = (a.out / "report.html").read_text()
    assert html.lstrip().lower().startswith("<!doctype html") and all(r in html for r in ran)
    sarif = json.loads((a.out / "findings.sarif").read_text())
    assert sarif["version"] == "2.1.0"
    assert sorted(r["ruleId"] for r in sarif["runs"][0]["results"]) == sorted(f["rule"] for f in doc["findings"])
    return doc


def rules(doc: dict, rule_id: str) -> list[dict]:
    return [f for f in doc["findings"] if f["rule"] == rule_id]


# ------------------------------------------------------------------------------------------------
# Recordings


def test_v100_workers0_is_dataloader_bound(analyzed) -> None:
    doc = check_contract(analyzed(W0))
    assert doc["source"] == "trace"
    steps = raw_steps(W0)
    loader = raw_loader_ms(W0)
    step_us = [hi - lo for lo, hi in steps]
    shares = [a / b for a, b in zip(loader, step_us)]
    assert len(steps) == 6 and 0.35 < min(shares) and max(shares) < 0.45  # 38-42% of every step
    # The recording's own ProfilerSteps are the run's steps, and the target is what was analysed.
    assert doc["target"] == str(W0)
    assert doc["steps"]["count"] == 6
    assert doc["steps"]["per_step_ms"] == pytest.approx([u / 1000 for u in step_us], abs=1e-3)
    assert doc["steps"]["median_ms"] == pytest.approx(statistics.median(step_us) / 1000, abs=1e-3)

    (f,) = rules(doc, "dataloader-bound")
    assert f["severity"] == "warning"
    per_step = f["evidence"]["steps"]
    assert [s["share"] for s in per_step] == pytest.approx(shares, abs=1e-4)
    assert [s["loader_ms"] for s in per_step] == pytest.approx([u / 1000 for u in loader], abs=1e-3)
    assert [s["ms"] for s in per_step] == pytest.approx([u / 1000 for u in step_us], abs=1e-3)
    assert f["cost"]["measured"] is True
    # the loader's time in the steps over their number (stalls in some steps would count their share)
    assert f["cost"]["ms_per_step"] == pytest.approx(sum(loader) / 6 / 1000, abs=1e-2)
    # its share: of the recording's time per step (its steps' span over their number), as every cost's
    base = (steps[-1][1] - steps[0][0]) / 6 / 1000
    assert doc["run_time"]["base_ms"] == pytest.approx(base, abs=1e-3)
    share = sum(loader) / 6 / 1000 / base
    assert f["cost"]["share_of_step"] == pytest.approx(share, abs=1e-4)
    assert f"({share:.0%} of the run's {base:.1f} ms a step;" in f["message"]
    assert f["fix"]["config"]["num_workers"] >= 1
    assert (f["locations"][0]["file"], f["locations"][0]["line"]) == ("resnet50_profiler_api.py", 42)


def test_v100_workers4_control_is_not_dataloader_bound(analyzed) -> None:
    doc = check_contract(analyzed(W4))
    shares = [a / (hi - lo) for a, (lo, hi) in zip(raw_loader_ms(W4), raw_steps(W4))]
    assert len(shares) == 6 and max(shares) < 0.03  # the control really loads in workers
    assert rules(doc, "dataloader-bound") == []
    assert "dataloader-bound" not in {s["rule"] for s in doc["skipped_rules"]}  # it ran, and stayed quiet
    # recorded with shapes (`Input Dims`) and stacks (old schema: operators' `Call stack`): no rule judged without them
    assert doc["judged_without"] == [] and "Judged without" not in (analyzed(W4).out / "report.html").read_text()


def test_a100_rank0_host_sync_is_the_75_copies_not_the_items(analyzed) -> None:
    doc = check_contract(analyzed(RANK0))
    items = [e for e in raw(RANK0) if e.get("name") == "aten::item"]
    syncs = [e for e in raw(RANK0) if e.get("name") == "cudaStreamSynchronize"]
    assert len(items) > 900 and len(syncs) == 75

    # the copies to pageable memory under `.to()` wait for the GPU as the syncs do (see test_trace_rules)
    dtoh = {e["args"]["correlation"] for e in raw(RANK0) if e.get("cat") == "gpu_memcpy"
            and e["name"] == "Memcpy DtoH (Device -> Pageable)"}
    copies = [e for e in raw(RANK0) if e.get("name") == "cudaMemcpyAsync" and e["args"].get("correlation") in dtoh]
    found = {f["evidence"]["op"]: f for f in rules(doc, "host-sync")}
    f = found["aten::to"]
    # each copy is inside one of the `.to()` calls whose stream sync follows it: 75 calls wait, not 105
    to_calls = [e for e in raw(RANK0) if e.get("cat") == "cpu_op" and e["name"] == "aten::to"]

    def call_of(row: dict) -> tuple:
        c = min((c for c in to_calls if c["tid"] == row["tid"] and c["ts"] <= row["ts"] < c["ts"] + c["dur"]),
                key=lambda c: c["ts"])
        return c["tid"], c["ts"]

    waited = {call_of(e) for e in syncs}
    assert {call_of(e) for e in copies} <= waited and len(waited) == len(syncs) == 75
    assert f["evidence"]["syncs"] == len(waited)
    assert f["evidence"]["apis"] == {"cudaStreamSynchronize": len(syncs), "cudaMemcpyAsync to pageable memory": 30}
    assert f["evidence"]["blocked_ms"] == pytest.approx(sum(e["dur"] for e in syncs + copies) / 1000, abs=1e-3)
    assert f["evidence"]["syncs_per_step"] == pytest.approx(len(waited) / len(raw_steps(RANK0)), abs=0.01)
    assert doc["environment"]["device"] == "cuda" and doc["environment"]["cuda_available"] is True
    # ~945 item() calls on CPU tensors synchronise nothing: no finding names them (the file name
    # itself contains "item", so it is taken out first).
    for g in doc["findings"]:
        # (gpu-idle's fix for idle behind syncs lists the usual ones, .item() among them: advice, not a claim)
        text = json.dumps({k: v for k, v in g.items() if not (g["rule"] == "gpu-idle" and k == "fix")})
        text = text.replace(RANK0.name, "")
        assert not re.search(r"item|_local_scalar_dense", text), (g["rule"], g["message"])
    # recorded with shapes (its header's `record_shapes`, operators' `Input Dims`) but without stacks (no
    # python_function event in it): the rules that read the user's lines say they judged it without them
    assert not any(e.get("cat") == "python_function" for e in raw(RANK0))
    assert doc["judged_without"] == [{"rule": r, "without": ["with_stack"]}
                                     for r in ("blocking-pinned-copy", "gpu-idle", "unfused-attention")]
    page = (analyzed(RANK0).out / "report.html").read_text()
    assert "<h3>Judged without what the trace did not record</h3>" in page
    assert f"profiler trace {RANK0.name} was recorded without stacks (with_stack)" in page


def test_fragmented_snapshot_is_flagged_with_its_figure(analyzed) -> None:
    doc = check_contract(analyzed(FRAGMENTED))
    assert doc["source"] == "snapshot"
    segs = raw_snapshot(FRAGMENTED)["segments"]
    reserved = sum(s["total_size"] for s in segs)
    free = [b["size"] for s in segs for b in s["blocks"] if b["state"] == "inactive"]
    empty = [s for s in segs if all(b["state"] == "inactive" for b in s["blocks"])]
    assert len(segs) == 1457 and max(free) == 314 * MiB

    (f,) = rules(doc, "allocator-fragmentation")
    e = f["evidence"]
    assert f["severity"] == "warning"
    assert (e["reserved"], e["free"], e["largest_free"]) == (reserved, sum(free), max(free))
    assert e["allocated"] == sum(b["size"] for s in segs for b in s["blocks"] if b["state"] == "active_allocated")
    assert e["segments"] == len(segs) and e["empty_segments"] == len(empty)
    assert e["free_share"] == pytest.approx(sum(free) / reserved, abs=1e-4)
    assert f["message"].startswith("GPU memory is fragmented: change the allocator's settings. "
                                   f"{sum(free) / GiB:.1f} GiB of the {reserved / GiB:.1f} GiB reserved")
    assert f["fix"]["config"] == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert f["cost"] is None  # a state snapshot carries no timing


def test_fail_on_sets_the_exit_code(tmp_path: Path) -> None:
    """The small A100 trace: a gpu-idle warning (98% idle) and info-level syncs, nothing at error."""
    lo, hi = raw_steps(SMALL)[0]
    busy = [e for e in raw(SMALL) if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    assert sum(e["dur"] for e in busy) / (hi - lo) < 0.1  # mostly idle: a warning is due
    warn = audit("analyze", str(SMALL), "--fail-on", "warning", "--quiet", out=tmp_path / "w")
    assert warn.returncode == 1, warn.stderr
    severities = {f["severity"] for f in warn.findings}
    assert "warning" in severities and "error" not in severities
    err = audit("analyze", str(SMALL), "--fail-on", "error", "--quiet", out=tmp_path / "e")
    assert err.returncode == 0, err.stderr
    assert [f["rule"] for f in err.findings] == [f["rule"] for f in warn.findings]


# ------------------------------------------------------------------------------------------------
# Bad input: exit 2, one line on stderr naming the input, no traceback, no report written


def one_line_error(a: Audit, names: str) -> str:
    assert a.returncode == 2, (a.returncode, a.stdout, a.stderr)
    lines = [ln for ln in a.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, a.stderr
    assert lines[0].startswith("audit: error:") and names in lines[0], lines[0]
    assert "Traceback" not in a.stdout + a.stderr
    assert not (a.out / "findings.json").exists()
    return lines[0]


def _truncated_gz(tmp: Path) -> Path:
    data = W0.read_bytes()
    p = tmp / "cut.pt.trace.json.gz"
    p.write_bytes(data[:len(data) // 2])
    return p


def _truncated_json(tmp: Path) -> Path:
    data = gzip.decompress(W0.read_bytes())
    p = tmp / "cut.pt.trace.json"
    p.write_bytes(data[:len(data) * 4 // 10])
    return p


def _garbage(tmp: Path) -> Path:
    p = tmp / "garbage.json"
    p.write_bytes(random.Random(0).randbytes(64 * 1024))
    return p


def _empty(tmp: Path) -> Path:
    p = tmp / "blank.pt.trace.json"
    p.write_bytes(b"")
    return p


def _not_a_trace(tmp: Path) -> Path:
    p = tmp / "config.json"
    p.write_text('{"a": 1}')
    return p


def _no_traces_dir(tmp: Path) -> Path:
    d = tmp / "logs"
    d.mkdir()
    (d / "notes.txt").write_text("no trace here")
    (d / "events.out.tfevents.1").write_bytes(b"\0" * 16)
    return d


@pytest.mark.parametrize("make,says", [
    (_truncated_gz, "gzip"),
    (_truncated_json, "truncated"),
    (_garbage, "not a JSON profiler trace"),
    (_empty, "is empty"),
    (_not_a_trace, "traceEvents"),
    (_no_traces_dir, "holds no"),
], ids=["truncated-gz", "truncated-json", "garbage", "empty", "not-a-trace", "dir-without-traces"])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, make, says: str) -> None:
    path = make(tmp_path)
    line = one_line_error(audit("analyze", str(path), out=tmp_path / "out"), path.name)
    assert says in line


class Payload:
    """Unpickling this runs `touch MARKER`: what a hostile "snapshot" would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def test_malicious_pickle_is_refused_without_running_it(tmp_path: Path) -> None:
    # The payload is live: plain pickle runs it.
    armed = tmp_path / "armed"
    pickle.loads(pickle.dumps(Payload(armed)))
    assert armed.exists()
    marker = tmp_path / "pwned"
    snap = tmp_path / "memory_snapshot.pickle"
    snap.write_bytes(pickle.dumps(Payload(marker), protocol=4))
    line = one_line_error(audit("analyze", str(snap), out=tmp_path / "out"), snap.name)
    assert "system" in line  # names the global it refused
    assert not marker.exists()
