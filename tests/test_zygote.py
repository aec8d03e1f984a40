"""The suite's audited processes are forked from a zygote (tests/zygote.py): the program must find
what it finds in the fresh process `audit` starts, or the suite tests something else."""
from __future__ import annotations

import json
import os

import pytest

import conftest
import zygote
from conftest import audit

SEES = """
import json, os, sys
import numpy as np
import torch
OPTIMIZER
seen = {
    "cwd": os.getcwd(), "env": dict(os.environ), "argv": sys.argv, "orig_argv": sys.orig_argv[1:],
    "path0": sys.path[0], "executable": sys.executable,
    "fds": len(os.listdir("/proc/self/fd")),  # (the record pipe's number is the worker's free one)
    "threads": len(os.listdir("/proc/self/task")),
    "modules": sorted(m for m in sys.modules if not m.startswith("_")),
    "numpy_draw": int(np.random.randint(1 << 30)),
    "torch_seed": torch.initial_seed(),
    "stdio": [os.path.realpath(f"/proc/self/fd/{fd}") for fd in (1, 2)],
}


def step(i):
    pass


with open(sys.argv[1], "w") as f:
    json.dump(seen, f)
"""


@pytest.fixture(autouse=True)
def own_zygotes(monkeypatch):
    """The worker's audits forked from zygotes of this test's own: what the worker's earlier tests
    did to its zygotes is not what these tests judge."""
    from auditor.capture import runner

    conftest._zygote()  # (the worker's, made first: it installs itself only when it is made)
    env, _ = runner.child_environment(dict(os.environ), profile=True)
    own = zygote.Zygotes(env)
    monkeypatch.setattr(conftest, "_ZYGOTE", [own])
    monkeypatch.setattr(runner, "start_child", own.start_child)
    yield own
    own.stop()


def _seen(tmp_path, name: str, forked: bool) -> dict:
    z = conftest._zygote()
    before, z.enabled = z.forked, forked
    try:
        a = audit("run", str(tmp_path / "sees.py"), "--steps", "2", "--no-profile", "--quiet", "--",
                  str(tmp_path / f"{name}.json"), out=tmp_path / name, cwd=tmp_path)
    finally:
        z.enabled = True
    assert a.returncode == 0, a.stderr
    assert z.forked == before + forked, z.stats()  # (this one was forked, or not)
    return json.loads((tmp_path / f"{name}.json").read_text())


# (a CUDA build of torch starts each child fresh: zygote.cuda_build)
pytestmark = pytest.mark.skipif(zygote.cuda_build(), reason="a CUDA build of torch: the suite forks no child")

# (a program that builds an optimizer is forked from the zygote that imported torch._dynamo: it
# has imported it too by then, as a fresh process has)
OPTIMIZER = "torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())\n"


@pytest.mark.parametrize("optimizer", ["", OPTIMIZER], ids=["plain", "optimizer"])
def test_a_forked_child_sees_what_a_fresh_one_does(tmp_path, optimizer):
    (tmp_path / "sees.py").write_text(SEES.replace("OPTIMIZER", optimizer))
    fresh, forked, again = _seen(tmp_path, "fresh", False), _seen(tmp_path, "forked", True), _seen(tmp_path, "again", True)
    for seen in (fresh, forked, again):
        seen["argv"] = seen["argv"][:1]  # (the output each names differs by run)
    # a fresh process's own draws differ from each other's, and so do two forked children's
    for key in ("numpy_draw", "torch_seed"):
        assert len({fresh.pop(key), forked.pop(key), again.pop(key)}) == 3, key
    assert forked["orig_argv"][:2] == ["-m", "auditor.capture.child"]
    for key in ("orig_argv", "stdio"):  # (--out and the outputs differ by run)
        fresh.pop(key), forked.pop(key), again.pop(key)
    for key in fresh:
        assert forked[key] == fresh[key], (key, forked[key], fresh[key])


def test_a_variable_the_worker_keeps_restarts_the_zygote_with_it(tmp_path, monkeypatch):
    """A library a test imports may set a variable in the worker for good (Lightning sets
    PYTORCH_NVML_BASED_CUDA_CHECK): the audits after it are forked from a zygote that imported with
    it, and their program sees it."""
    (tmp_path / "sees.py").write_text(SEES.replace("OPTIMIZER", ""))
    z = conftest._zygote()
    before = _seen(tmp_path, "before", True)
    restarts = z.restarts
    monkeypatch.setenv("AUDIT_TESTS_KEPT", "1")
    after = _seen(tmp_path, "after", True)
    assert z.restarts > restarts
    assert "AUDIT_TESTS_KEPT" not in before["env"] and after["env"]["AUDIT_TESTS_KEPT"] == "1"


def test_a_zygote_that_died_is_started_again(tmp_path):
    """A zygote process that died (a signal sent to the worker's process group) is started again
    by the next request, which is forked, not refused for the rest of the worker's tests."""
    import signal

    (tmp_path / "sees.py").write_text(SEES.replace("OPTIMIZER", ""))
    z = conftest._zygote()
    _seen(tmp_path, "before", True)
    z.plain._proc.send_signal(signal.SIGKILL)
    z.plain._proc.wait()
    died = len(z.plain.died)
    _seen(tmp_path, "after", True)
    assert z.plain.died[died:] == [-signal.SIGKILL]
