"""TensorBoard really serves a run's profiler traces: a real trace, a real server, the plugin's API.

The trace is written by torch.profiler's own tensorboard_trace_handler over a tiny CPU model, the
same way a run directory's `tb/` is filled, and read back through torch-tb-profiler's HTTP routes
(/data/plugin/pytorch_profiler/runs, /workers, /overview), so a change in either package that breaks
"open your traces in TensorBoard" shows up here.
"""
from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from auditor.reports.tensorboard import (TensorBoardError, plugin_url, start_tensorboard, stop_tensorboard,
                                         tensorboard_available)

from conftest import ROOT

torch = pytest.importorskip("torch")

_missing = tensorboard_available()
pytestmark = pytest.mark.skipif(_missing is not None, reason=_missing or "")


def _get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _write_trace(logdir: Path, run: str = "run") -> Path:
    """Profile three steps of a tiny model into logdir/run, as the capture does for a run dir."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    sched = torch.profiler.schedule(wait=0, warmup=1, active=2, repeat=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=sched,
                                on_trace_ready=torch.profiler.tensorboard_trace_handler(str(logdir / run))) as prof:
        for _ in range(3):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            prof.step()
    files = list((logdir / run).glob("*.pt.trace.json*"))
    assert files, "torch.profiler wrote no trace"
    return files[0]


def _wait_for_run(url: str, run: str, timeout_s: float = 45.0) -> dict:
    """The plugin loads runs in a background thread; poll /runs until ours is listed and loaded."""
    deadline = time.monotonic() + timeout_s
    data: dict = {}
    while time.monotonic() < deadline:
        data = _get_json(plugin_url(url, "runs"))  # type: ignore[assignment]
        if run in data.get("runs", []) and not data.get("loading"):
            return data
        time.sleep(0.3)
    raise AssertionError(f"run {run!r} never loaded; last /runs answer: {data}")


def _overview(url: str, run: str) -> dict:
    """The plugin's Overview page data for the run's first worker and span, as the UI asks for it."""
    q = urllib.parse.quote
    workers = _get_json(plugin_url(url, f"workers?run={q(run)}&view={q('Overview')}"))
    assert isinstance(workers, list) and workers, workers
    worker = workers[0]
    spans = _get_json(plugin_url(url, f"spans?run={q(run)}&worker={q(worker)}"))
    span = spans[0] if spans else ""
    overview = _get_json(plugin_url(url, f"overview?run={q(run)}&worker={q(worker)}&span={q(span)}"))
    assert isinstance(overview, dict)
    assert "steps" in overview and overview["steps"]["rows"], overview.keys()
    return overview


def test_tensorboard_serves_profiler_run(tmp_path: Path) -> None:
    logdir = tmp_path / "tb"
    _write_trace(logdir, "myrun")
    url, proc = start_tensorboard(logdir)
    try:
        assert url.startswith("http://127.0.0.1:")
        _wait_for_run(url, "myrun")
        overview = _overview(url, "myrun")
        envs = {e["title"]: e["value"] for e in overview["environments"]}
        assert envs["Device Type"] == "CPU"
    finally:
        stop_tensorboard(proc)
    assert proc.poll() is not None


def test_start_tensorboard_reports_a_server_that_dies(tmp_path: Path) -> None:
    """A server that exits at start-up (here: a flag it does not know) is an error carrying its output."""
    with pytest.raises(TensorBoardError, match=r"(?s)exited with code 2.*unrecognized arguments: --no_such_flag"):
        start_tensorboard(tmp_path, extra_args=["--no_such_flag"], timeout_s=60)


def test_audit_run_tensorboard_serves_the_audited_run(tmp_path):
    """`audit run --tensorboard` prints a URL whose plugin lists the audited run, workers and overview."""
    import os
    import signal
    import subprocess
    import sys

    root = ROOT
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "auditor", "run", "examples/clean.py:step", "--steps", "8",
                             "--quiet", "--tensorboard", "--out", str(out)], cwd=root, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        url = None
        for line in proc.stdout:
            if line.startswith("TensorBoard: "):
                url = line.split()[1].split("#")[0]
                break
        assert url, proc.stderr.read()
        runs = _wait_for_run(url, "clean-step")
        assert "clean-step" in runs["runs"]
        overview = _overview(url, "clean-step")
        # one row per active step of the audit's profiler window
        from auditor.capture.child import profile_plan

        assert len(overview["steps"]["rows"]) == len(profile_plan(8)[1])
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
    assert proc.returncode == 0


def test_the_report_says_how_to_open_a_trace_named_otherwise(tmp_path: Path) -> None:
    """`prof.export_chrome_trace("trace.json")` writes a file the plugin does not read (it reads
    `<logdir>/<run>/*.pt.trace.json[.gz]`): the report said `tensorboard --logdir` the file's
    parent's parent, where TensorBoard found nothing. It now gives the copy that makes it a run, and
    TensorBoard serves it."""
    import html
    import re
    import subprocess

    from conftest import audit

    logdir_trace = _write_trace(tmp_path / "elsewhere")
    trace = tmp_path / "work" / "trace.json"
    trace.parent.mkdir()
    trace.write_bytes(logdir_trace.read_bytes())
    a = audit("analyze", str(trace), out=tmp_path / "out", cwd=trace.parent)
    assert a.returncode == 0, a.stderr
    page = (tmp_path / "out" / "report.html").read_text()
    command = html.unescape(re.search(r"then\s+<code>(.*?)</code>", page, re.S).group(1))
    assert command == f"mkdir -p tb/run && cp {trace} tb/run/trace.pt.trace.json && tensorboard --logdir tb"
    subprocess.run(command.split(" && tensorboard")[0], shell=True, check=True, cwd=trace.parent)
    url, proc = start_tensorboard(trace.parent / "tb")
    try:
        _wait_for_run(url, "run")
    finally:
        stop_tensorboard(proc)
    # the clean case: a trace in a run folder is opened from the logdir above it
    a = audit("analyze", str(logdir_trace), out=tmp_path / "out2")
    page = (tmp_path / "out2" / "report.html").read_text()
    assert f"<code>tensorboard --logdir {tmp_path / 'elsewhere'}</code>" in page
