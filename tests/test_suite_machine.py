"""The suite runs on a CUDA machine as on a CPU one.

Its tests describe a machine without a GPU (rehearsal, CPU step times, CPU tensors' syncs), so
conftest.py hides the CUDA devices from the suite and from every process it starts; and no test
takes a name that a common pytest plugin owns (pytest-benchmark, common on GPU images, stops the
run with INTERNALERROR when a test's `benchmark` argument is not its fixture).
"""
from __future__ import annotations

import ast
import json
import os

import pytest
import torch
from conftest import ROOT, audit

# Fixture names owned by widely installed plugins, from their sources: pytest-benchmark
# (plugin.py: benchmark, benchmark_weave), pytest-mock (mocker and its scoped twins), pytest-asyncio
# (event_loop), pytest-cov (cov, no_cover), pytest-xdist (worker_id, testrun_uid), pytest-subtests
# (subtests), pytest-httpserver (httpserver), syrupy and pytest-snapshot (snapshot), Faker (faker),
# requests-mock (requests_mock), pytest-datadir (datadir, shared_datadir), anyio (anyio_backend).
PLUGIN_FIXTURES = {
    "benchmark", "benchmark_weave", "mocker", "class_mocker", "module_mocker", "package_mocker", "session_mocker",
    "event_loop", "cov", "no_cover", "worker_id", "testrun_uid", "subtests", "httpserver", "snapshot", "faker",
    "requests_mock", "datadir", "shared_datadir", "anyio_backend",
}

ASKS_FOR_CUDA = '''import os
import torch

device = "cuda" if torch.cuda.is_available() else "cpu"
w = torch.zeros(4, device=device, requires_grad=True)
with open(os.environ["SEEN_OUT"], "w") as f:
    f.write(repr(os.environ.get("CUDA_VISIBLE_DEVICES")))


def step():
    (w * 2).sum().backward()
'''


@pytest.mark.slow
def test_the_suite_and_its_audits_see_no_cuda_device(tmp_path):
    """In the suite's process torch finds no device, and an audited CUDA program is rehearsed with
    the devices hidden from it too: on a CUDA machine it would otherwise run on the GPU."""
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert torch.cuda.device_count() == 0 and not torch.cuda.is_available()
    (tmp_path / "train.py").write_text(ASKS_FOR_CUDA)
    a = audit("run", f"{tmp_path / 'train.py'}:step", "--steps", "2", "--no-profile", "--quiet",
              out=tmp_path / "out", env={"SEEN_OUT": str(tmp_path / "seen.txt")})
    assert a.returncode == 0, a.stderr
    assert "audit: no CUDA device here: rehearsing this CUDA program" in a.stderr
    assert (tmp_path / "seen.txt").read_text() == repr("")
    assert json.loads((a.out / "findings.json").read_text())["steps"]["count"] == 2


def _names_defined(path) -> set[tuple[str, int]]:
    """(name, line) of every fixture the file defines and every argument it parametrizes: the names
    it gives a value of its own (using a plugin's fixture, as xdist's `worker_id`, is what it is for)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                "fixture" in ast.unparse(d) for d in node.decorator_list):
            names.add((node.name, node.lineno))
        elif (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("parametrize") and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names |= {(n.strip(), node.lineno) for n in node.args[0].value.split(",")}
    return names


def test_no_test_takes_a_name_a_common_plugin_owns():
    taken = [f"{path.relative_to(ROOT)}:{line} {name}" for path in sorted((ROOT / "tests").rglob("*.py"))
             for name, line in _names_defined(path) if name in PLUGIN_FIXTURES]
    assert taken == []
