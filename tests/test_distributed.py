"""Distributed audits for real: two ranks on CPU (gloo), launched by PyTorch's own launcher, either
through `audit run --nproc-per-node 2` or by the user (`torch.distributed.run ... -m auditor run`).

Expected numbers are recomputed here from each rank's own evidence.json with the standard library,
not through auditor.evidence.ranks. The distributed rules are applied by instantiating them on the
merged evidence (so these tests hold before and after their entry points are registered); the
registration and the `audit analyze` wiring have their own tests, marked xfail until they exist.
"""
from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from statistics import median

import pytest
import torch

from conftest import (
    EXAMPLES,
    FIXTURES,
    audit,
    balanced_ddp_run,
    data_parallel_run,
    graded_severity,
    expected_lines,
    find_unused_run,
    metric_ddp_run,
    straggler_ddp_run,
)

from auditor.evidence.model import Evidence
from auditor.reports.rank_plots import rank_figure, rank_rows
from auditor.evidence.load import merge_inputs
from auditor.evidence.ranks.combine import combine
from auditor.evidence.ranks.model import RankInfo, RankStep
from auditor.evidence.ranks.view import rank_set
from auditor.evidence.store import load_run_dir, save
from auditor.rules.base import Rule
from auditor.findings import Finding
from auditor.rules.collective_wait import CollectiveWait
from auditor.rules.data_parallel import DataParallel
from auditor.rules.ddp_config import DdpConfig
from auditor.rules.rank_straggler import RankStraggler

DDP_TRACE = FIXTURES / "traces" / "a100_ddp_nccl_2rank.pt.trace.json.gz"
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # what torchrun sets per rank; the single-process runs match it
RUN_TIMEOUT = 150


def findings(out: Path, rule_cls: type[Rule]) -> list[Finding]:
    """The rule's findings on the merged evidence saved in `out`, with its default options."""
    ev = load_run_dir(out)
    rule = rule_cls()
    assert rule.skip_reason(ev) is None, rule.skip_reason(ev)
    return list(rule.check(ev, rule.default_options()))


def raw_rank(out: Path, rank: int) -> dict:
    return json.loads((out / f"rank-{rank}" / "evidence.json").read_text())


def locations(f: Finding) -> set[tuple[str, int]]:
    return {(loc.file, loc.line) for loc in f.locations}


def marked(example: str, rule_id: str) -> set[tuple[str, int]]:
    path = EXAMPLES / f"{example}.py"
    lines = expected_lines(path, rule_id)
    assert lines, f"{example} has no # expect: {rule_id} marker"
    return {(str(path), n) for n in lines}


# ---------------------------------------------------------------------------------------------
# Runs shared by several tests (each a real 2-rank job).

@pytest.fixture(scope="module")
def straggler(tmp_path_factory) -> Path:
    return straggler_ddp_run(tmp_path_factory)


@pytest.fixture(scope="module")
def balanced(tmp_path_factory) -> Path:
    return balanced_ddp_run(tmp_path_factory)


@pytest.fixture(scope="module")
def metric(tmp_path_factory) -> tuple[Path, str]:
    return metric_ddp_run(tmp_path_factory)


# ---------------------------------------------------------------------------------------------
# rank-straggler and the merged per-rank view.

def _grad_sync_ms(step: dict) -> float:
    return sum(b["sync_ms"] for b in step["distributed"]["backward_syncs"] if b["synced"])


def _data_ms(step: dict) -> float:
    return sum(t["ms"] for t in step["tallies"] if t["kind"] == "data-wait")


def test_slow_rank_is_named_with_its_phase_and_the_wait(straggler):
    merged = json.loads((straggler / "evidence.json").read_text())
    assert [r["rank"] for r in merged["ranks"]["ranks"]] == [0, 1]
    assert all(len(r["steps"]) == 12 for r in merged["ranks"]["ranks"])
    assert (straggler / "report.html").is_file() and (straggler / "findings.json").is_file()

    [f] = findings(straggler, RankStraggler)
    assert f.evidence["stragglers"] == [1] and f.evidence["phase"] == "data"
    assert locations(f) == marked("ddp_straggler", "rank-straggler")
    steps = f.evidence["steps_compared"]
    assert len(steps) >= 3
    r0 = {s["index"]: s for s in raw_rank(straggler, 0)["steps"]}
    r1 = {s["index"]: s for s in raw_rank(straggler, 1)["steps"]}
    # rank 1 sleeps 0.8 ms per sample, 128 samples per batch: at least 102.4 ms more data loading
    data_excess = median(_data_ms(r1[i]) - _data_ms(r0[i]) for i in steps)
    assert f.evidence["phase_excess_ms"]["1"]["data"] == pytest.approx(data_excess, abs=0.01)
    assert data_excess >= 0.8 * 102.4
    # rank 0's wait: its gradient sync beyond rank 1's (the transfer), the one sync point per step
    wait = median(_grad_sync_ms(r0[i]) - _grad_sync_ms(r1[i]) for i in steps)
    assert f.evidence["others_wait_ms"] == pytest.approx(wait, abs=0.01)
    assert wait >= 0.5 * data_excess
    assert f.cost.ms_per_step == pytest.approx(wait, abs=0.01)


def test_rank_costs_are_shares_of_the_stated_runs_time(straggler):
    """rank-straggler and collective-wait state their costs' shares of the run's time per step
    findings.json (and the headline) states, in the message too, as every rule does; before, of the
    median of the compared ranks' steps, a second basis for the same report."""
    doc = json.loads((straggler / "findings.json").read_text())
    base = doc["run_time"]["base_ms"]
    timed = [f for f in doc["findings"] if f["rule"] in ("rank-straggler", "collective-wait")
             and f["cost"]["ms_per_step"] is not None]
    assert {f["rule"] for f in timed} == {"rank-straggler", "collective-wait"}
    for f in timed:
        share = f["cost"]["share_of_step"]
        assert share == round(f["cost"]["ms_per_step"] / base, 4), f["rule"]
        if "share_by_rank" in f["evidence"] or f["rule"] == "rank-straggler":
            assert f"({share:.0%} of the run's time)" in f["message"], f["message"]


def test_the_wait_shows_as_collective_wait_on_the_fast_rank(straggler):
    shares = [f for f in findings(straggler, CollectiveWait) if "share_by_rank" in f.evidence]
    assert len(shares) == 1
    f = shares[0]
    assert f.evidence["share_by_rank"]["0"] > 0.3 > f.evidence["share_by_rank"]["1"]
    assert "gradients" in f.evidence["wait_ms_by_kind"]
    assert any(loc.code.strip() == "loss.backward()" for loc in f.locations)
    assert findings(straggler, DdpConfig) == []


def test_per_rank_view_and_figure(straggler):
    ev = load_run_dir(straggler)
    rows = rank_rows(ev)
    assert [r["rank"] for r in rows] == [0, 1]
    assert rows[1]["phases_ms"]["data"] > rows[0]["phases_ms"]["data"]
    assert rows[0]["median_wait_ms"] > rows[1]["median_wait_ms"]
    fig = rank_figure(ev)
    names = {t.name for t in fig.data}
    assert {"rank 0", "rank 1", "data loading", "waiting for other ranks"} <= names
    step_lines = [t for t in fig.data if t.type == "scatter" and t.yaxis == "y"]
    assert [list(t.x) for t in step_lines] == [list(range(12))] * 2


def test_analyze_of_rank_directories_holds_the_primary_trace_as_a_sketch(straggler):
    """`audit analyze`'s driver holds rank 0's profiled trace as a sketch; the rules, run where it
    is parsed again, find what they find on the trace parsed here."""
    from auditor.evidence.load import load_paths
    from auditor.evidence.ranks.engines import EngineSpec
    from auditor.evidence.ranks.sketch import SketchTrace
    from auditor.rules.engine import run_rules

    dirs = [straggler / "rank-0", straggler / "rank-1"]
    sketched = load_paths(dirs, EngineSpec(sketch=True))
    parsed = load_paths(dirs)
    assert [type(t) for t in sketched.trace_data] == [SketchTrace] and type(parsed.trace_data[0]) is not SketchTrace
    found = run_rules(sketched).findings
    assert "rank-straggler" in {f.rule for f in found} and found == run_rules(parsed).findings


def test_straggler_found_from_the_per_rank_traces_alone(straggler, tmp_path):
    traces = sorted(straggler.glob("rank-*/tb/*/*.pt.trace.json*"))
    assert len(traces) == 2  # one real trace per rank of the run above
    for t in traces:
        shutil.copy(t, tmp_path / t.name)
    ev, _ = merge_inputs([tmp_path])
    assert ev is not None and ev.source == "trace"
    rs = rank_set(ev)
    assert [r.rank for r in rs.ranks] == [0, 1] and rs.world_size == 2
    [f] = RankStraggler().check(ev, RankStraggler.default_options())
    assert f.evidence["stragglers"] == [1] and f.evidence["phase"] == "data" and f.evidence["source"] == "trace"


def test_balanced_ranks_stay_quiet(balanced):
    assert RankStraggler().skip_reason(load_run_dir(balanced)) is None
    assert findings(balanced, RankStraggler) == []
    assert [f for f in findings(balanced, CollectiveWait) if f.severity != "info"] == []
    assert findings(balanced, DdpConfig) == []
    rs = rank_set(load_run_dir(balanced))
    assert [len(r.steps) for r in rs.ranks] == [10, 10] and rs.missing == []


# ---------------------------------------------------------------------------------------------
# collective-wait at the user's line, under a user-launched torchrun (rank 0 merges).

def test_metric_all_reduce_is_flagged_at_its_line(metric):
    out, stdout = metric
    assert "audit: rank 0:" in stdout and "audit: rank 1:" in stdout
    assert (out / "evidence.json").is_file() and (out / "report.html").is_file()  # built by rank 0
    sites = [f for f in findings(out, CollectiveWait) if f.evidence.get("op") == "all_reduce"]
    assert len(sites) == 1
    f = sites[0]
    assert locations(f) == marked("ddp_metric_allreduce", "collective-wait")
    assert f.evidence["calls"] == 8 and f.evidence["steps"] == 8 and f.evidence["bytes_per_call"] == 4
    raw = [c for s in raw_rank(out, 0)["steps"] for c in s["distributed"]["collectives"]]
    assert f.evidence["ms_per_step"] == pytest.approx(sum(c["total_ms"] for c in raw) / 8, rel=1e-3)
    assert len(f.evidence["wait_ms_total"]) == 2  # compared on both ranks


def test_rank_directories_merge_later_with_analyze(metric, tmp_path):
    out, _ = metric
    for r in (0, 1):  # as if each node kept its own directory
        shutil.copytree(out / f"rank-{r}", tmp_path / f"node{r}" / f"rank-{r}")
    ev, _ = merge_inputs([tmp_path / "node0" / "rank-0", tmp_path / "node1" / "rank-1"])
    assert ev is not None
    rs = rank_set(ev)
    assert [r.rank for r in rs.ranks] == [0, 1] and rs.world_size == 2
    shutil.copytree(tmp_path / "node1" / "rank-1", tmp_path / "node0" / "rank-1")
    ev, _ = merge_inputs([tmp_path / "node0"])
    assert [r.rank for r in rank_set(ev).ranks] == [0, 1]
    assert merge_inputs([out / "rank-0"])[0] is None  # one plain run directory: the ordinary path


# ---------------------------------------------------------------------------------------------
# ddp-config and data-parallel.

def test_find_unused_parameters_with_every_parameter_used(tmp_path_factory):
    # A configuration question: one rank (the example's own one-process group) answers it.
    a = find_unused_run(tmp_path_factory)
    assert a.returncode == 0, a.stderr
    tmp_path = a.out
    [f] = findings(tmp_path, DdpConfig)
    assert f.evidence["check"] == "find_unused_parameters"
    assert locations(f) == marked("ddp_find_unused", "ddp-config")
    raw = json.loads((tmp_path / "evidence.json").read_text())
    params = raw["distributed"]["ddp"][0]["params"]
    assert params == 6 and f.evidence["steps_all_used"] == 6
    assert all(s["distributed"]["params_with_grad"]["0"] == params for s in raw["steps"])
    assert f.fix.config == {"DistributedDataParallel.find_unused_parameters": False}
    [edit] = f.fix.edits
    assert "find_unused_parameters" not in edit.lines[0] and "DDP(mlp())" in edit.lines[0]


def test_accumulation_without_no_sync_and_unchanged_buffers(tmp_path):
    a = audit("run", "examples/ddp_accumulate.py:step", "--steps", "5", "--no-profile", "--quiet", out=tmp_path,
              env=ONE_THREAD)
    assert a.returncode == 0, a.stderr
    by_check = {f.evidence["check"]: f for f in findings(tmp_path, DdpConfig)}
    assert set(by_check) == {"broadcast_buffers", "no_sync"}
    for f in by_check.values():
        assert marked("ddp_accumulate", "ddp-config") <= locations(f)
    raw = json.loads((tmp_path / "evidence.json").read_text())
    syncs = [[b["sync_ms"] for b in s["distributed"]["backward_syncs"]] for s in raw["steps"]]
    assert all(len(s) == 2 for s in syncs)  # ACCUM = 2 synced backward passes per optimizer step
    nosync = by_check["no_sync"]
    assert nosync.evidence["extra_sync_ms"] == pytest.approx(median(s[0] for s in syncs), abs=1e-3)
    buf = by_check["broadcast_buffers"]
    assert buf.evidence["buffers"] == 1 and buf.evidence["steps_unchanged"] == 5
    [edit] = buf.fix.edits  # forward_sync_buffers on torch versions that have it, else broadcast_buffers
    assert "forward_sync_buffers=False" in edit.lines[0] or "broadcast_buffers=False" in edit.lines[0]


def test_changing_buffers_and_accumulation_inside_no_sync_are_not_flagged(tmp_path):
    trainer = tmp_path / "bn.py"
    trainer.write_text(
        "import torch, torch.distributed as dist\nfrom torch import nn\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "model = DDP(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "def step(i):\n    opt.zero_grad()\n    with model.no_sync():\n"
        "        model(torch.randn(16, 8)).sum().backward()\n"
        "    model(torch.randn(16, 8)).sum().backward()\n    opt.step()\n")
    a = audit("run", f"{trainer}:step", "--steps", "4", "--no-profile", "--quiet", out=tmp_path / "out",
              env=ONE_THREAD)
    assert a.returncode == 0, a.stderr
    raw = json.loads((tmp_path / "out" / "evidence.json").read_text())
    assert raw["distributed"]["ddp"][0]["buffers"] == 3  # running mean, var, num_batches_tracked
    assert all(s["distributed"]["buffers_changed"]["0"] for s in raw["steps"])
    assert all([b["synced"] for b in s["distributed"]["backward_syncs"]] == [False, True]
               and s["distributed"]["no_sync_entries"] == 1 for s in raw["steps"])
    assert findings(tmp_path / "out", DdpConfig) == []


def test_data_parallel_is_flagged(tmp_path_factory):
    a = data_parallel_run(tmp_path_factory)
    assert a.returncode == 0, a.stderr
    tmp_path = a.out
    [f] = findings(tmp_path, DataParallel)
    assert f.severity == "warning" and f.evidence["training"] is True and f.evidence["forward_calls"] == 4
    assert locations(f) == marked("ddp_data_parallel", "data-parallel")
    assert RankStraggler().skip_reason(load_run_dir(tmp_path)) is not None  # one process: nothing to compare


# ---------------------------------------------------------------------------------------------
# A rank that dies mid-run.

CRASHING = '''
import os
import time
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)


def step(i):
    if rank == 1 and i == 3:
        os._exit(7)
    if rank == 0 and i == 3:
        {rank0_in_step3}
    opt.zero_grad()
    F.cross_entropy(model(torch.randn(16, 32)), torch.randint(0, 4, (16,))).backward()
    opt.step()
'''


@pytest.mark.parametrize("rank0_in_step3,rank0_status", [
    # blocked in the gradient all-reduce: gloo sees the peer go, or the launcher stops it
    ("pass", ("raised", "crashed")),
    ("time.sleep(60)", ("crashed",)),  # busy in its own code: only the launcher's SIGTERM stops it
])
def test_a_crashed_rank_still_leaves_a_report_of_every_rank(tmp_path, rank0_in_step3, rank0_status):
    (tmp_path / "trainer.py").write_text(CRASHING.replace("{rank0_in_step3}", rank0_in_step3))
    out = tmp_path / "out"
    for stale in (2, 1):  # an earlier, larger run into the same DIR: never merged into this one
        save(Evidence(target="stale"), out / f"rank-{stale}")
        (out / f"rank-{stale}" / ".audit-run").write_text("an-earlier-run")
    a = audit("run", f"{tmp_path / 'trainer.py'}:step", "--nproc-per-node", "2", "--steps", "8", "--no-profile",
              "--quiet", out=out, timeout=RUN_TIMEOUT)
    assert a.returncode == 3, a.stderr
    doc = json.loads((out / "findings.json").read_text())
    assert doc["ending"]["status"] == "crashed" and doc["ending"]["step"] == 3
    assert doc["ending"]["message"].startswith("rank 1:") and doc["ending"]["returncode"] == 7
    r1, r0 = raw_rank(out, 1), raw_rank(out, 0)
    assert len(r1["steps"]) == 3 and r1["ending"]["status"] == "crashed"
    assert r0["ending"]["status"] in rank0_status and r0["ending"]["step"] == 3, r0["ending"]
    if rank0_in_step3 != "pass":
        assert r0["ending"]["signal"] == "SIGTERM"
    rs = rank_set(load_run_dir(out))
    assert {r.rank: r.status for r in rs.ranks} == {0: r0["ending"]["status"], 1: "crashed"}
    assert r1["target"] != "stale" and rs.missing == []
    assert (out / "report.html").is_file()


# ---------------------------------------------------------------------------------------------
# Recorded multi-GPU traces: the merge path of `audit analyze`.

def _nccl_ms_per_step(path: Path) -> dict[int, float]:
    """NCCL kernel time per ProfilerStep, by the step their launch (matched by correlation id) is in."""
    with gzip.open(path, "rt") as fh:
        events = json.load(fh)["traceEvents"]
    steps = [(int(e["name"].split("#")[1]), e["ts"], e["ts"] + e["dur"]) for e in events
             if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")]
    launch_ts = {e["args"]["correlation"]: e["ts"] for e in events
                 if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    out: dict[int, float] = {}
    for e in events:
        if e.get("cat") == "kernel" and "nccl" in e["name"].lower():
            ts = launch_ts.get(e["args"].get("correlation"))
            for n, lo, hi in steps:
                if ts is not None and lo <= ts < hi:
                    out[n] = out.get(n, 0.0) + e["dur"] / 1e3
    return out


def test_recorded_gpu_traces_merge_by_rank(tmp_path):
    # The fixture is rank 0 of a real 2-rank NCCL job. Rank 1 here is the same recording with its
    # distributedInfo relabelled: it exercises the merge, and with identical timings no rank may
    # wait for another nor be a straggler.
    shutil.copy(DDP_TRACE, tmp_path / "rank0.pt.trace.json.gz")
    with gzip.open(DDP_TRACE, "rt") as fh:
        doc = json.load(fh)
    assert doc["distributedInfo"]["rank"] == 0 and doc["distributedInfo"]["world_size"] == 2
    doc["distributedInfo"]["rank"] = 1
    with gzip.open(tmp_path / "rank1-relabelled.pt.trace.json.gz", "wt") as fh:
        json.dump(doc, fh)
    ev, _ = merge_inputs([tmp_path])
    rs = rank_set(ev)
    assert [r.rank for r in rs.ranks] == [0, 1] and rs.world_size == 2 and rs.source == "trace"
    assert len(ev.trace_data) == 1 and ev.traces == [str(tmp_path / "rank0.pt.trace.json.gz")]
    expected = _nccl_ms_per_step(DDP_TRACE)
    assert sorted(expected) == [4, 5, 6]
    for info in rs.ranks:
        assert {s.index: s.comm_ms for s in info.steps} == pytest.approx(expected, abs=2e-3)
        assert all(s.wait_ms == 0.0 for s in info.steps)
    assert list(RankStraggler().check(ev, RankStraggler.default_options())) == []
    assert list(CollectiveWait().check(ev, CollectiveWait.default_options())) == []


def test_one_rank_trace_alone_is_one_rank_of_two(tmp_path):
    from auditor.evidence.load import load_paths

    ev = load_paths([DDP_TRACE])
    rs = rank_set(ev)
    assert [r.rank for r in rs.ranks] == [0] and rs.world_size == 2 and rs.missing == [1]
    assert RankStraggler().skip_reason(ev) is not None
    assert merge_inputs([DDP_TRACE])[0] is None  # nothing to merge: load_paths' ordinary path


# ---------------------------------------------------------------------------------------------
# The arithmetic of "beyond the transfer", on tiny hand-made cases.

def _info(rank: int, n_steps: int) -> RankInfo:
    return RankInfo(rank=rank, steps=[RankStep(index=i, ms=100.0) for i in range(n_steps)])


@pytest.mark.parametrize("points,expected", [
    # one sync point; the last to arrive (shortest time in it) sets the transfer
    ({0: {"grad:0:0": 30.0}, 1: {"grad:0:0": 5.0}}, {0: 25.0, 1: 0.0}),
    # three ranks, two sync points, waits add up per rank
    ({0: {"a@f:1#0": 4.0, "grad:0:0": 10.0}, 1: {"a@f:1#0": 1.0, "grad:0:0": 12.0},
      2: {"a@f:1#0": 2.0, "grad:0:0": 2.0}}, {0: 11.0, 1: 10.0, 2: 1.0}),
    # a sync point one rank lacks is not compared; equal times mean nobody waits
    ({0: {"grad:0:0": 7.0, "grad:0:1": 50.0}, 1: {"grad:0:0": 7.0}}, {0: 0.0, 1: 0.0}),
])
def test_wait_is_time_beyond_the_fastest_rank(points: dict[int, dict[str, float]], expected: dict[int, float]):
    rs = combine([(_info(r, 1), {0: p}) for r, p in points.items()], len(points), "run")
    assert {i.rank: i.steps[0].wait_ms for i in rs.ranks} == pytest.approx(expected)


def test_a_single_rank_has_no_wait_to_compare():
    rs = combine([(_info(0, 2), {0: {"grad:0:0": 9.0}, 1: {"grad:0:0": 9.0}})], 4, "run")
    assert [s.wait_ms for s in rs.ranks[0].steps] == [None, None] and rs.missing == [1, 2, 3]


# ---------------------------------------------------------------------------------------------
# The wiring: entry points and load_paths.

def test_distributed_rules_are_registered():
    from auditor.rules.registry import all_rules

    assert {"rank-straggler", "collective-wait", "ddp-config", "data-parallel"} <= set(all_rules())


def test_analyze_merges_rank_directories_and_traces(metric, tmp_path):
    out, _ = metric
    for r in (0, 1):
        shutil.copytree(out / f"rank-{r}", tmp_path / "ranks" / f"rank-{r}")
    a = audit("analyze", str(tmp_path / "ranks" / "rank-0"), str(tmp_path / "ranks" / "rank-1"), "--quiet",
                   out=tmp_path / "again")
    assert a.returncode == 0, a.stderr
    assert [r["rank"] for r in a.evidence["ranks"]["ranks"]] == [0, 1]
    shutil.copy(DDP_TRACE, tmp_path / "t0.pt.trace.json.gz")
    with gzip.open(DDP_TRACE, "rt") as fh:
        doc = json.load(fh)
    doc["distributedInfo"]["rank"] = 1  # relabelled copy, as in test_recorded_gpu_traces_merge_by_rank
    with gzip.open(tmp_path / "t1.pt.trace.json.gz", "wt") as fh:
        json.dump(doc, fh)
    a = audit("analyze", str(tmp_path / "t0.pt.trace.json.gz"), str(tmp_path / "t1.pt.trace.json.gz"), "--quiet",
                   out=tmp_path / "traces")
    assert a.returncode == 0, a.stderr
    assert [r["rank"] for r in a.evidence["ranks"]["ranks"]] == [0, 1]



# ---------------------------------------------------------------------------------------------
# ddp-config's bucket-size thresholds, on hand-made evidence (a CPU test machine cannot hold a
# model big enough for them): what DDP reported about its buckets, and the timed gradient syncs.

def _bucket_evidence(grad_mb: float, cap_mb: float, buckets: list[float], sync_ms: float) -> Evidence:
    import msgspec

    from auditor.evidence.distributed import DistInfo, DistStep
    from auditor.evidence.model import StepRecord

    mb = 2**20
    ddp = {"index": 0, "where": None, "find_unused_parameters": False, "gradient_as_bucket_view": True,
           "broadcast_buffers": True, "buffers": 0, "buffer_bytes": 0, "params": 10, "grad_bytes": int(grad_mb * mb),
           "largest_grad_bytes": int(grad_mb * mb / 10), "bucket_cap_bytes": int(cap_mb * mb),
           "bucket_sizes": [int(b * mb) for b in buckets]}
    steps = [StepRecord(index=i, start_s=i * 0.1, ms=100.0, distributed=msgspec.convert({
        "backward_syncs": [{"ddp": 0, "synced": True, "sync_ms": sync_ms}], "ddp_forwards": [],
        "buffers_changed": {}, "params_with_grad": {"0": 10}}, DistStep)) for i in range(4)]
    return Evidence(steps=steps, distributed=msgspec.convert({"ddp": [ddp], "data_parallel": []}, DistInfo))


@pytest.mark.parametrize("grad_mb,cap_mb,buckets,sync_ms,expected", [
    (400.0, 1024.0, [400.0], 30.0, {"suggested_bucket_cap_mb": 100}),  # one bucket, 30% of the step after backward
    (400.0, 1024.0, [400.0], 2.0, None),  # one bucket, but the sync after backward is cheap
    (8.0, 25.0, [8.0], 30.0, None),  # one bucket of a small model: nothing to overlap
    (100.0, 1.0, [1.0] * 100, 5.0, {"buckets": 100}),  # a hundred 1 MiB buckets
    (100.0, 25.0, [25.0] * 4, 5.0, None),  # DDP's default
])
def test_bucket_size_thresholds(grad_mb, cap_mb, buckets, sync_ms, expected):
    found = [f for f in DdpConfig().check(_bucket_evidence(grad_mb, cap_mb, buckets, sync_ms),
                                          DdpConfig.default_options()) if f.evidence["check"] == "bucket_size"]
    if expected is None:
        assert found == []
    else:
        [f] = found
        assert {k: f.evidence[k] for k in expected} == expected


def test_launch_opens_the_merged_report(ddp_program_launched):
    """`--open` under `--nproc-per-node`: the merged report, once written, goes to the browser (the
    launch of DDP_SCRIPT below, whose other outputs test_a_ddp_program_runs_on_every_rank_... reads)."""
    p, out, opened = ddp_program_launched
    assert p.returncode == 0, p.stderr[-3000:]
    assert opened.read_text().strip() == (out / "report.html").resolve().as_uri()


# ---------------------------------------------------------------------------------------------
# A job written for GPUs (NCCL, DDP on the local device), audited on this CPU machine.

GPU_DDP = """import os
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

local_rank = int(os.environ.get("LOCAL_RANK", 0))
torch.cuda.set_device(local_rank)
dist.init_process_group(backend="nccl")
device = torch.device("cuda", local_rank)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(device)
model = DDP(model, device_ids=[local_rank], output_device=local_rank)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(dist.get_rank())
data = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(4)]
history = []


def step(i):
    x, y = (t.to(device, non_blocking=True) for t in data[i % 4])
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    history.append(mean.item() / dist.get_world_size())
    if i == STEPS - 1 and dist.get_rank() == 0:
        torch.save(model.module.state_dict(), os.environ["PARITY_OUT"])


STEPS = 4
if __name__ == "__main__":
    for i in range(STEPS):
        step(i)
    dist.barrier()  # (gloo may abort a rank that tears down while its peer still runs, or exits with its group up)
    dist.destroy_process_group()
"""


def test_a_gpu_ddp_job_is_rehearsed_on_gloo(tmp_path):
    """init_process_group("nccl") and DDP(device_ids=[local_rank]) ended every rank at setup on a
    CPU build ("Distributed package doesn't have NCCL built in"). Rehearsed, the ranks run on gloo
    and DDP holds the module without device ids; the job is audited as GPU code and trains what
    the same job on gloo and the CPU trains."""
    trainer = tmp_path / "gpu_ddp.py"
    trainer.write_text(GPU_DDP)
    out = tmp_path / "out"
    a = audit("run", f"{trainer}:step", "--nproc-per-node", "2", "--steps", "4", "--no-profile", "--quiet",
              out=out, timeout=RUN_TIMEOUT, env={"PARITY_OUT": str(tmp_path / "audited.pt")})
    assert a.returncode == 0, a.stderr[-3000:]
    assert "NCCL" not in a.stderr
    lines = GPU_DDP.splitlines()
    line_of = {text: n for n, text in enumerate(lines, 1)}
    for r in (0, 1):
        raw = raw_rank(out, r)
        assert raw["ending"]["status"] == "completed" and len(raw["steps"]) == 4
        standins = {(t["what"], t["where"]["line"]) for t in raw["setup"] if t["kind"] == "cuda-standin"}
        assert ("torch.distributed.init_process_group(backend='nccl') on gloo",
                line_of['dist.init_process_group(backend="nccl")']) in standins
        assert ("DistributedDataParallel(device_ids, output_device) on the CPU",
                line_of["model = DDP(model, device_ids=[local_rank], output_device=local_rank)"]) in standins
    [wait] = [f for f in findings(out, CollectiveWait) if f.evidence.get("op") == "all_reduce"]
    assert locations(wait) == {(str(trainer), line_of["    dist.all_reduce(mean)"])}
    doc = json.loads((out / "findings.json").read_text())
    [sync] = [f for f in doc["findings"] if f["rule"] == "host-sync"]
    assert sync["severity"] == graded_severity(sync, doc) and sync["evidence"]["judged_as_gpu_code"] is True
    assert [(s["what"], s["line"], s["per_step"]) for s in sync["evidence"]["sites"]] == [
        ("Tensor.item", line_of["    history.append(mean.item() / dist.get_world_size())"], 1.0)]
    # the same job for the CPU, on gloo, without the audit
    plain = tmp_path / "cpu_ddp.py"
    plain.write_text(GPU_DDP.replace('"nccl"', '"gloo"').replace('"cuda"', '"cpu"')
                     .replace("torch.cuda.set_device(local_rank)", "")
                     .replace(", device_ids=[local_rank], output_device=local_rank", ""))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(plain)], capture_output=True, text=True, cwd=tmp_path, timeout=RUN_TIMEOUT,
                       env={**os.environ, **ONE_THREAD, "PARITY_OUT": str(tmp_path / "plain.pt")})
    # (the reference run only has to write its weights, at its last step: gloo sometimes aborts a
    # plain rank at teardown on this loaded machine, after that, with "terminate called without an
    # active exception", though the job calls barrier() and destroy_process_group() first)
    teardown = "terminate called without an active exception" in p.stderr and (tmp_path / "plain.pt").exists()
    assert p.returncode == 0 or teardown, p.stderr[-3000:]
    want, got = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "audited.pt")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


# ---------------------------------------------------------------------------------------------
# Whole programs across ranks: a DDP training script as users write it, launched unmodified.

DDP_SCRIPT = """import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=1000)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for i in range(args.iters):
            x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
            if rank == 1:
                time.sleep(0.1)  # this rank's batches arrive late (well past the steps' jitter: graph scans, checks)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)  # the loss averaged over ranks, every step
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""


def _launch_ddp_program(folder: Path, how: str, *extra: str, env: dict | None = None):
    """DDP_SCRIPT as FOLDER/train.py, audited on 2 ranks for 5 steps of its 40 (`how`: the auditor's
    --nproc-per-node, or the user's own torchrun): (the process, its --out folder)."""
    (folder / "train.py").write_text(DDP_SCRIPT)
    out = folder / "out"
    opts = ["--steps", "5", "--no-profile", "--quiet", *extra, "--out", str(out), "--", "--iters", "40"]
    if how == "nproc-per-node":
        cmd = [sys.executable, "-m", "auditor", "run", "--nproc-per-node", "2", "train.py", *opts]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "auditor", "run", "train.py", *opts]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=folder, timeout=RUN_TIMEOUT,
                       env={**os.environ, **ONE_THREAD, **(env or {})})
    return p, out


@pytest.fixture(scope="module")
def ddp_program_launched(tmp_path_factory):
    """`audit run --nproc-per-node 2 train.py --open` of DDP_SCRIPT, with a BROWSER that writes the
    address it is given to a file: (the process, its --out folder, that file). One launch serves
    the whole-program test and --open's."""
    folder = tmp_path_factory.mktemp("ddp_program")
    opened = folder / "opened.txt"
    browser = folder / "browser.sh"
    browser.write_text(f'#!/bin/sh\necho "$1" > {opened}\n')
    browser.chmod(0o755)
    p, out = _launch_ddp_program(folder, "nproc-per-node", "--open", env={"BROWSER": f"{browser} %s"})
    return p, out, opened


@pytest.mark.slow
@pytest.mark.parametrize("how", ["nproc-per-node", "torchrun"])
def test_a_ddp_program_runs_on_every_rank_and_stops_at_the_same_step(tmp_path, request, how):
    """`audit run --nproc-per-node 2 train.py -- ARGS` (refused before: 'takes a step callable for
    now') and the user's own `torchrun ... -m auditor run train.py -- ARGS`: each rank runs the
    script as torchrun would, finds its steps from its optimizer steps and is ended by --steps 5
    at the same step boundary (neither waits in a collective for the other); the merged report
    has both ranks, rank 1 as the straggler and the per-step all_reduce at its line."""
    if how == "nproc-per-node":  # (the module's launch, with --open: test_launch_opens_the_merged_report)
        p, out, _ = request.getfixturevalue("ddp_program_launched")
    else:
        p, out = _launch_ddp_program(tmp_path, how)
    script = out.parent / "train.py"
    assert p.returncode == 0, p.stderr[-3000:]
    line_of = {text.strip(): n for n, text in enumerate(DDP_SCRIPT.splitlines(), 1)}
    reduce_line = line_of["dist.all_reduce(mean)  # the loss averaged over ranks, every step"]
    for r in (0, 1):
        raw = raw_rank(out, r)
        assert raw["ending"]["status"] == "completed", raw["ending"]
        assert [s["index"] for s in raw["steps"]] == [0, 1, 2, 3, 4]
        prog = raw["program"]
        assert prog["argv"] == ["train.py", "--iters", "40"] and prog["steps_by"] == "optimizer"
        assert prog["ended_by_audit"] is True
        reduces = [(c["where"]["line"], c["calls"]) for s in raw["steps"] for c in s["distributed"]["collectives"]
                   if c["op"] == "all_reduce"]
        assert reduces == [(reduce_line, 1)] * 5
    merged = json.loads((out / "evidence.json").read_text())
    assert [(r["rank"], len(r["steps"])) for r in merged["ranks"]["ranks"]] == [(0, 5), (1, 5)]
    [straggler] = findings(out, RankStraggler)
    assert straggler.evidence["stragglers"] == [1]
    waits = [f for f in findings(out, CollectiveWait) if f.evidence.get("op") == "all_reduce"]
    assert waits and all(locations(f) == {(str(script), reduce_line)} for f in waits)


def test_a_module_program_is_launched_with_its_dash_m():
    """Each rank gets the launching `audit run`'s options whole, as one record: quiet, into the
    launch's directory, launching nothing itself; the program's arguments after `--`."""
    from auditor.command_options import RunOptions, decode
    from auditor.launch import launcher_command, rank_argv

    options = RunOptions(steps=5, profile=False, skip=2, nproc_per_node=2, select=("host-sync",), device_memory=8.0)
    cmd = launcher_command("-m pkg.train", 2, rank_argv(options, Path("out"), ("--lr", "1")))
    assert cmd[cmd.index("run"):cmd.index("run") + 4] == ["run", "-m", "pkg.train", "--options-json"]
    assert cmd[cmd.index("run") + 5:] == ["--", "--lr", "1"]
    rank = decode(cmd[cmd.index("run") + 4], RunOptions)
    assert rank == RunOptions(steps=5, profile=False, skip=2, select=("host-sync",), device_memory=8.0, quiet=True,
                              out=Path("out"))
    assert launcher_command("train.py", 2, ["--options-json", "{}"])[-4:] == ["run", "train.py", "--options-json", "{}"]


def test_a_module_program_no_launch_would_find_is_a_usage_error(tmp_path):
    """Each rank's own 'no such module' would be lost in the launcher's failure (exit 3, 'no rank
    wrote evidence'): the launching `audit run` finds it first, without starting any rank."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text("print('trained')\n")
    a = audit("run", "--nproc-per-node", "2", "-m", "pkg.trian", "--steps", "2", out=tmp_path / "o", cwd=tmp_path)
    assert a.returncode == 2 and a.stderr.strip() == "audit: error: no such module: pkg.trian", a.stderr
    assert "torch.distributed" not in a.stderr and not (tmp_path / "o").exists()
