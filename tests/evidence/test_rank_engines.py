"""`audit analyze` of a job's per-rank traces on the engines (auditor.evidence.ranks.engines): each
rank's trace reduced apart to a RankSummary, merged in the driver. A job of 16 ranks made from the
recorded 2-rank DDP fixture (tests/evidence/rank_jobs.py), rank 5 slowed by 1.5x."""
from __future__ import annotations

import gzip
import json
import os
import sys
from pathlib import Path

import msgspec
import pytest
from conftest import audit
from rank_jobs import write_job

from auditor.evidence.ranks.engines import EngineSpec, reduce_all
from auditor.evidence.ranks.job import header_rank, is_rank_job, merge_summaries
from auditor.evidence.ranks.summary import RankFailure, RankSummary, reduce_trace

N = 16
SLOW = 5
HOSTS = {r: f"node-{r // 8}" for r in range(N)}


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("job")
    write_job(d, N, slow=(SLOW,), hosts=HOSTS)
    return d


def _findings(a) -> list[tuple]:
    return [(f["rule"], f["message"], json.dumps(f["evidence"], sort_keys=True)) for f in a.findings]


@pytest.fixture(scope="module")
def serial(job, tmp_path_factory):
    a = audit("analyze", str(job), "--workers", "1", "--quiet", out=tmp_path_factory.mktemp("serial"))
    assert a.returncode == 0, a.stderr
    return a


def test_summary_is_small_and_typed(job):
    s = reduce_trace(str(job / f"rank-{SLOW}.pt.trace.json.gz"))
    assert isinstance(s, RankSummary) and s.rank == SLOW and s.world_size == N and s.hostname == "node-0"
    assert [st.index for st in s.info.steps] == [4, 5, 6]
    assert s.digest.comm_kernels == 21 and s.digest.steps == 3 and s.digest.devices == ["NVIDIA A100-PG509-200"]
    assert 0 < s.digest.exposed_comm_ms <= s.digest.comm_ms
    # what travels to the driver, and what it holds per rank: a sync point's key names its kernel by a
    # checksum (the full NCCL kernel names made it 3.3 KB here, most of it the same names again)
    assert len(msgspec.msgpack.encode(s)) < 2500
    assert all(len(k) <= 20 for points in s.syncs.values() for k in points)


def test_serial_names_the_straggler_and_its_host(serial):
    [f] = serial.rule("rank-straggler")
    assert f["evidence"]["stragglers"] == [SLOW]
    assert serial.rule("collective-wait")
    rs = serial.evidence["ranks"]
    assert [r["rank"] for r in rs["ranks"]] == list(range(N)) and rs["world_size"] == N
    assert [r["hostname"] for r in rs["ranks"]] == [HOSTS[r] for r in range(N)]


def test_local_pool_gives_the_serial_findings(job, serial, tmp_path):
    a = audit("analyze", str(job), "--engine", "local", "--workers", "2", "--quiet", out=tmp_path)
    assert a.returncode == 0, a.stderr
    assert _findings(a) == _findings(serial)


def test_dask_cluster_gives_the_serial_findings(job, serial, tmp_path):
    distributed = pytest.importorskip("dask.distributed")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, protocol="tcp",
                                  dashboard_address=None) as cluster:
        a = audit("analyze", f"{job}/rank-*.pt.trace.json.gz", "--engine", "dask", "--address",
                  cluster.scheduler_address, "--quiet", out=tmp_path)
    assert a.returncode == 0, a.stderr
    assert _findings(a) == _findings(serial), (a.stderr, a.evidence.get("unread"))
    assert a.findings_doc["target"] == f"{job}/rank-*.pt.trace.json.gz"  # the pattern, not 16 paths


def _ray_processes(temp: str) -> list[str]:
    """Command lines of the processes that run a Ray cluster whose session lives under `temp`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            env = (proc / "environ").read_bytes()
        except OSError:
            continue
        if temp in cmd or temp.encode() in env:
            found.append(cmd)
    return found


@pytest.fixture
def ray_temp():
    """A Ray temp directory of the test's own (short: Ray's socket paths must fit 107 bytes), so that
    the processes its clusters start can be found, and none is left running after the test."""
    pytest.importorskip("ray", reason="ray is not installed here (pip install 'auditor[ray]')")
    import shutil
    import tempfile

    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    try:
        yield temp
        assert _ray_processes(temp) == []
    finally:
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_ray_local_cluster_gives_the_serial_findings(job, serial, tmp_path, ray_temp):
    """`--engine ray` without an address starts a local Ray for the run (and ends it)."""
    a = audit("analyze", str(job), "--engine", "ray", "--workers", "2", "--quiet", out=tmp_path,
              env={"RAY_TMPDIR": ray_temp, "RAY_ADDRESS": ""})
    assert a.returncode == 0, a.stderr
    assert a.stderr == ""  # (Ray's own log lines stay in its logs)
    [f] = a.rule("rank-straggler")
    assert f["evidence"]["stragglers"] == [SLOW]
    assert _findings(a) == _findings(serial)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("AUDIT_RAY_CLUSTER_TEST"),
                    reason="starts a Ray head (`ray start`, ~7 s) and a driver on it: ~22 s on 2 busy cores, "
                           "over the suite's budget; AUDIT_RAY_CLUSTER_TEST=1 runs it")
def test_ray_cluster_named_by_ray_address(job, serial, tmp_path, ray_temp):
    """`--engine ray` with RAY_ADDRESS set (and no --address) runs on that cluster: a head the test
    starts with `ray start --head --block`, ended by its own pid (SIGTERM stops its processes)."""
    import signal
    import socket
    import subprocess
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "RAY_TMPDIR": ray_temp, "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": ""}
    ray_cli = Path(sys.executable).with_name("ray")
    head = subprocess.Popen([str(ray_cli), "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
                             "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={ray_temp}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        for line in head.stdout:  # ("Ray runtime started." once the head accepts drivers)
            if b"Ray runtime started" in line or time.monotonic() > deadline:
                break
        a = audit("analyze", str(job), "--engine", "ray", "--quiet", out=tmp_path,
                  env={"RAY_ADDRESS": f"127.0.0.1:{port}", "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": ray_temp})
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
    assert a.returncode == 0, a.stderr
    assert _findings(a) == _findings(serial)


def test_engines_in_process_agree_on_every_summary(job):
    """The pool returns what reducing in this process returns, in the order of the inputs."""
    paths = sorted(str(p) for p in job.iterdir())
    here = reduce_all(paths, EngineSpec(workers=1))
    pooled = reduce_all(paths, EngineSpec(workers=2))
    strip = [msgspec.structs.replace(s, seconds=0.0) for s in here]
    assert [msgspec.structs.replace(s, seconds=0.0) for s in pooled] == strip


def _damage(path: Path) -> None:
    data = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(data[:len(data) * 2 // 3]))  # cut mid-way: the array never closes


def test_a_damaged_rank_is_listed_and_the_rest_analyzed(job, tmp_path):
    d = tmp_path / "job"
    d.mkdir()
    for p in job.iterdir():
        (d / p.name).write_bytes(p.read_bytes())
    _damage(d / "rank-3.pt.trace.json.gz")
    (d / "rank-9.pt.trace.json.gz").write_bytes(b"\x00 not gzip, not json")  # no header either
    a = audit("analyze", str(d), "--workers", "2", out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    assert "2 rank input(s) not read, the other 14 analysed" in a.stderr
    assert "rank-3.pt.trace.json.gz: truncated" in a.stderr and "rank-9.pt.trace.json.gz" in a.stderr
    assert "Traceback" not in a.stderr
    rs = a.evidence["ranks"]
    assert [r["rank"] for r in rs["ranks"]] == [r for r in range(N) if r not in (3, 9)]
    assert sorted(Path(u["path"]).name for u in rs["unread"]) == ["rank-3.pt.trace.json.gz", "rank-9.pt.trace.json.gz"]
    assert rs["missing"] == [3, 9]
    [f] = a.rule("rank-straggler")
    assert f["evidence"]["stragglers"] == [SLOW]


def test_no_readable_rank_is_one_line_and_exit_2(job, tmp_path):
    d = tmp_path / "job"
    d.mkdir()
    for p in sorted(job.iterdir())[:4]:
        (d / p.name).write_bytes(p.read_bytes())
        _damage(d / p.name)
    a = audit("analyze", str(d), "--workers", "2", out=tmp_path / "out")
    assert a.returncode == 2
    lines = a.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("audit: error: none of the 4 rank traces could be read"), a.stderr


def test_a_missing_engine_is_one_line_and_exit_2(job, tmp_path):
    import subprocess

    code = ("import sys; sys.modules['dask'] = None; sys.modules['dask.distributed'] = None; "
            "from auditor.cli import main; main(sys.argv[1:])")
    p = subprocess.run([sys.executable, "-c", code, "analyze", str(job), "--engine", "dask", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "audit: error: --engine dask needs dask.distributed, which is not installed here "
        "(import of dask.distributed halted; None in sys.modules): pip install 'auditor[dask]'"]


def test_header_decides_a_rank_job_without_parsing_events(job, tmp_path):
    paths = sorted(job.iterdir())
    assert header_rank(paths[0]) == (True, 0) and is_rank_job(paths)
    assert not is_rank_job(paths[:1] * 2)  # one rank twice: not a job of two ranks
    one = tmp_path / "plain.pt.trace.json"
    one.write_text('{"traceEvents": [{"ph": "X", "name": "a", "ts": 1, "dur": 1, "pid": 1, "tid": 1}]}')
    assert header_rank(one) == (True, None) and not is_rank_job([one, *paths])


def test_merge_of_summaries_matches_the_per_rank_merge(job):
    """The summaries merge to the RankSet the parsed traces merge to (auditor.evidence.ranks.traces)."""
    from auditor.evidence.ranks.traces import merge_traces
    from auditor.evidence.trace.load import load_trace

    paths = sorted(job.iterdir())[:4]
    ev = merge_summaries([reduce_trace(str(p)) for p in paths])
    old, _ = merge_traces(load_trace(p) for p in paths)
    strip = [msgspec.structs.replace(r, hostname="") for r in ev.ranks.ranks]
    assert strip == old.ranks.ranks
    assert len(ev.trace_data) == 1 and ev.traces == [str(paths[0])]
    failed = merge_summaries([RankFailure(path="x", reason="x: bad"), reduce_trace(str(paths[1])),
                              reduce_trace(str(paths[2]))], load_primary=False)
    assert [u.path for u in failed.ranks.unread] == ["x"] and failed.trace_data == []


@pytest.mark.slow
def test_dask_without_an_address_starts_a_local_cluster_for_the_run(tmp_path):
    pytest.importorskip("dask.distributed")
    write_job(tmp_path / "job", 4, slow=(2,))
    env = {"DASK_SCHEDULER_ADDRESS": ""}  # (none: the engine starts its own LocalCluster of 2 processes)
    a = audit("analyze", str(tmp_path / "job"), "--engine", "dask", "--workers", "2", "--quiet",
              out=tmp_path / "out", env=env)
    assert a.returncode == 0, a.stderr
    [f] = a.rule("rank-straggler")
    assert f["evidence"]["stragglers"] == [2]


def test_the_driver_holds_the_primary_rank_as_a_sketch_and_finds_the_same(job):
    """The driver keeps no trace's events (the primary rank's trace is a sketch, made by its worker);
    the rules, run on its full trace in a process of their own, find what they find on the trace
    parsed here."""
    from auditor.evidence.load import load_paths
    from auditor.evidence.ranks.sketch import SketchTrace
    from auditor.evidence.trace.load import load_trace
    from auditor.rules.engine import run_rules

    ev = load_paths([job], EngineSpec(workers=2, sketch=True))
    [sketch] = ev.trace_data
    assert isinstance(sketch, SketchTrace) and len(sketch.events) <= 3 < sketch.sketch.events
    assert [s.index for s in ev.ranks.ranks[0].steps] == sketch.steps["step"].tolist()
    results = run_rules(ev)
    full = load_trace(sketch.path)
    full.label = sketch.label
    ev.__dict__["trace_data"] = [full]
    assert sketch.top_ops(20) == full.top_ops(20)
    assert sketch.window() == full.window() and sketch.median_step_ms() == full.median_step_ms()
    direct = run_rules(ev)
    assert {f.rule for f in results.findings} >= {"rank-straggler", "gpu-idle", "exposed-comm"}
    assert results.findings == direct.findings and results.skipped == direct.skipped
    # a primary rank's trace whose worker kept no sketch is sketched apart; without `sketch` (audit
    # diff compares the trace's events) it is parsed
    paths = sorted(str(p) for p in job.iterdir())[:3]
    assert isinstance(merge_summaries([reduce_trace(p) for p in paths], sketch=True).trace_data[0], SketchTrace)
    assert not isinstance(load_paths([job], EngineSpec(workers=1)).trace_data[0], SketchTrace)
