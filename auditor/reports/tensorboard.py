"""Serving a run's profiler traces in TensorBoard (with the torch-tb-profiler plugin).

A run directory keeps its traces under `tb/` as a TensorBoard logdir, so the richest view of a
profiled window is one `tensorboard --logdir DIR/tb` away. This module starts that server on a
loopback port and waits until it answers, so `audit` (or a test) can print or open a URL that
works. TensorBoard is an optional dependency: nothing else in the package imports this module's
subprocess target, and `tensorboard_available()` says whether it can be used.
"""
from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

PLUGIN = "pytorch_profiler"  # torch-tb-profiler's plugin name: its HTTP API is /data/plugin/<PLUGIN>/...


class TensorBoardError(RuntimeError):
    """TensorBoard could not be started or did not answer in time; the message has its output."""


def tensorboard_available() -> str | None:
    """None when TensorBoard and torch-tb-profiler can be used, else why not (for a skip or a hint)."""
    for module, package in (("tensorboard", "tensorboard"), ("torch_tb_profiler", "torch-tb-profiler")):
        if importlib.util.find_spec(module) is None:
            return f"{package} is not installed (pip install tensorboard torch-tb-profiler)"
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it; a tiny race is accepted)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _answers(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback URL we built
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def start_tensorboard(logdir: str | Path, port: int = 0, *, host: str = "127.0.0.1", timeout_s: float = 60.0,
                      extra_args: Sequence[str] = ()) -> tuple[str, subprocess.Popen]:
    """Start `python -m tensorboard.main` on `logdir`; return its base URL once it answers HTTP.

    port=0 picks a free port; `extra_args` go to TensorBoard as they are (e.g. --samples_per_plugin).
    The caller owns the process: stop it with `stop_tensorboard`.
    The server's output goes to a temporary file (a pipe nobody reads could fill and stall it);
    its tail is put in the error when the server dies or never answers.
    """
    port = port or free_port(host)
    url = f"http://{host}:{port}/"
    log = tempfile.TemporaryFile(mode="w+b")
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", host,
           "--port", str(port), "--load_fast=false", *extra_args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        if _answers(url, timeout=2.0):
            log.close()
            return url, proc
        time.sleep(0.2)
    exited = proc.poll()
    stop_tensorboard(proc)
    log.seek(0)
    tail = log.read().decode("utf-8", "replace")[-4000:]
    log.close()
    state = f"exited with code {exited}" if exited is not None else f"did not answer within {timeout_s:.0f} s"
    raise TensorBoardError(f"TensorBoard on {url} {state}: {' '.join(cmd)}\n{tail}")


def stop_tensorboard(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """Terminate the server, and kill it if it does not exit in time."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def plugin_url(base_url: str, route: str) -> str:
    """The URL of a torch-tb-profiler API route, e.g. plugin_url(url, "runs")."""
    return f"{base_url.rstrip('/')}/data/plugin/{PLUGIN}/{route.lstrip('/')}"
