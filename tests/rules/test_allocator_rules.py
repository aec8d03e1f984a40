"""allocator-churn and reserved-overhang on synthetic snapshots (tests/data/make_allocator_snapshots.py),
in-process and through `audit analyze`, with their controls; findings.json's `allocator` section."""
from __future__ import annotations

import json
import pickle

from auditor.config import Config
from auditor.evidence.load import load_paths
from auditor.evidence.snapshot import GiB, MiB
from auditor.rules.engine import run_rules

from conftest import FIXTURES, ROOT, audit

DATA = ROOT / "tests" / "data"
TRANSFORMER = FIXTURES / "snapshots" / "transformer_fullstep_with_history.pickle"


def _findings(path, rule_id):
    ev = load_paths([path])
    results = run_rules(ev, Config(select=[rule_id]))
    return [f for f in results.findings if f.rule == rule_id]


def test_churn_names_the_request_the_step_and_the_setting_that_removes_it():
    (f,) = _findings(DATA / "allocator_churn.pickle", "allocator-churn")
    e = f.evidence
    assert e["retries"] == 1 and e["capacity_source"] == "churn in the trace"
    assert e["churn"][0]["requested"] == 700 * MiB and e["churn"][0]["bytes_freed"] == 600 * MiB
    assert e["per_step"] == {"1": 1}
    assert [(loc.file, loc.line) for loc in f.locations] == [("/work/train.py", 12)]
    assert "expandable_segments:True" in e["removed_by"]
    assert f.fix.config == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert "1 -> 0 segment frees" in f.fix.summary


def test_churn_control_is_silent():
    assert _findings(DATA / "allocator_calm.pickle", "allocator-churn") == []
    assert _findings(TRANSFORMER, "allocator-churn") == []


def test_churn_through_audit_analyze(tmp_path):
    out = tmp_path / "out"
    r = audit("analyze", str(DATA / "allocator_churn.pickle"), out=out)
    assert r.returncode == 0, r.stderr
    doc = json.loads((out / "findings.json").read_text())
    assert [f["rule"] for f in doc["findings"]] == ["allocator-churn"]
    a = doc["allocator"]
    assert a["recorded"] == a["replayed"] == {"reserved_peak_bytes": 700 * MiB, "allocated_peak_bytes": 700 * MiB,
                                              "segment_allocs": 2, "segment_frees": 1}
    assert {"alloc_conf", "reserved_peak_bytes", "segment_allocs", "segment_frees",
            "largest_free_block_bytes"} <= set(a["what_if"][0])
    text = (out / "summary.txt").read_text()  # (the replay's lines: --verbose's)
    assert text.index("allocator replay of cuda:0") < text.index("what if expandable_segments:True")


def test_overhang_held_to_the_end_suggests_empty_cache_between_phases(tmp_path):
    (f,) = _findings(DATA / "reserved_overhang.pickle", "reserved-overhang")
    assert f.evidence["overhang_bytes"] == 4 * GiB  # the 4 GiB segment, cached after its buffer was freed
    assert f.evidence["to_end"] and f.evidence["seconds"] >= 50
    assert "empty_cache() once" in f.fix.summary and "never inside the step loop" in f.fix.summary


def test_overhang_silent_when_the_cache_is_returned(tmp_path):
    snap = pickle.loads((DATA / "reserved_overhang.pickle").read_bytes())
    trace = snap["device_traces"][0]
    i = next(k for k, e in enumerate(trace) if e["action"] == "free_completed")
    trace.insert(i + 1, {"action": "segment_free", "addr": trace[0]["addr"], "size": 4 * GiB, "stream": 0,
                         "time_us": trace[i]["time_us"]})
    snap["segments"] = snap["segments"][1:]
    p = tmp_path / "returned.pickle"
    p.write_bytes(pickle.dumps(snap, protocol=4))
    assert _findings(p, "reserved-overhang") == []
    assert _findings(TRANSFORMER, "reserved-overhang") == []  # a 0.56 s step: the cache serves it


def test_oom_risk_fix_quotes_the_simulated_saving_and_drops_what_does_not_help(tmp_path):
    from auditor.evidence.snapshot import load_snapshot
    from auditor.rules.oom_risk import _config_fix
    snap = load_snapshot(TRANSFORMER)
    fix = _config_fix(snap, 5 * GiB, "at the peak", True)
    assert "reserved peak 56.9 -> 51.8 GiB, 0 -> 0 segment frees" in fix.summary
    assert fix.config == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    # one 4 GiB buffer, then nothing: expandable segments would reserve the same, so it is not offered
    over = load_snapshot(DATA / "reserved_overhang.pickle")
    fix = _config_fix(over, 4 * GiB, "at the peak", True)
    assert fix.config == {} and "would not help" in fix.summary


def test_churn_forecast_for_a_smaller_device(tmp_path):
    """--device-memory: the calm stream on a 1 GiB device would free its cache to retry."""
    out = tmp_path / "out"
    r = audit("analyze", str(DATA / "allocator_calm.pickle"), "--device-memory", "1", out=out)
    assert r.returncode == 0, r.stderr
    doc = json.loads((out / "findings.json").read_text())
    (f,) = [f for f in doc["findings"] if f["rule"] == "allocator-churn"]
    assert f["evidence"]["capacity_source"] == "given" and f["evidence"]["churn"][0]["recorded"] is False
    assert doc["allocator"]["replayed"]["segment_frees"] == 1 and doc["allocator"]["recorded"]["segment_frees"] == 0


# A real recording: CS336's 2.7B-parameter transformer forward pass on an 80 GB GPU, with history
# (kkaitlyn111/cs336-a2-systems, commit 46eae3f, memory_2.7b_forward.pickle; gzipped here). Its
# trace opens with the 742 segment_free entries of the program's torch.cuda.empty_cache() at
# benchmark.py:424 (their stacks pass through THCPModule_emptyCache), then the forward pass
# cudaMallocs 178 segments again.
CS336_FORWARD = DATA / "cs336_2.7b_forward.pickle.gz"


def _unzipped(tmp_path):
    import gzip

    path = tmp_path / "memory_2.7b_forward.pickle"
    path.write_bytes(gzip.decompress(CS336_FORWARD.read_bytes()))
    return path


def test_a_recorded_empty_cache_is_replayed_and_its_churn_named(tmp_path):
    """The replay seeded the 742 emptied segments as cache and never let them go: 0 of the 178
    recorded segment allocations, and allocator-churn silent. Replayed as recorded (the release at
    its place), the reserve follows the recording exactly, and the churn is named at the call."""
    from auditor.evidence.allocator.analysis import analyze
    from auditor.evidence.snapshot import load_snapshot

    path = _unzipped(tmp_path)
    r = analyze(load_snapshot(path), 0)
    assert (r.recorded.segment_allocs, r.recorded.segment_frees) == (178, 742)
    assert r.replayed == r.recorded
    assert r.error.reserved_max_diff_bytes == 0
    assert r.churn == []  # no cudaMalloc failed: nothing the allocator released on its own
    [rel] = r.releases
    assert (rel.index, rel.segments_freed, rel.segments_regrown) == (0, 742, 178)
    assert rel.file.endswith("cs336_systems/benchmark.py") and rel.line == 424
    assert (r.without_releases.segment_allocs, r.without_releases.segment_frees) == (0, 0)

    (f,) = _findings(path, "allocator-churn")
    assert f.severity == "info" and [(loc.file.rsplit("/", 1)[-1], loc.line) for loc in f.locations] == \
        [("benchmark.py", 424)]
    assert f.message.startswith(
        "The GPU cache is emptied, then filled again: drop empty_cache(). "
        "On cuda:0 the program's torch.cuda.empty_cache() at benchmark.py:424 returned 742 cached segment(s), "
        "19.5 GiB, to CUDA (1 call(s), recorded), and the requests after it cudaMalloc'd 178 segment(s), 3.7 GiB, "
        "again"), f.message
    assert "Replayed without the call, the same requests reuse the cache: segment allocs 178 -> 0, frees 742 -> 0" \
        in f.message
