"""memory-growth names a line in the user's code: the line that fills the holder the graph scans
found (a variable a hook's closure keeps among them), else, when no name they reach holds the
memory (a list a hook's functools.partial keeps), the line
whose allocations the recorded allocator history saw stay alive and grow at every step's end
(here a CUDA rehearsal's, with --device-memory); the forecast OOM names that line too."""
from __future__ import annotations

import pytest

from conftest import ROOT, audit

PROGRAM = ROOT / "tests" / "data" / "hook_keep_cuda.py"


@pytest.mark.slow
@pytest.mark.parametrize("clean", [False, True])
def test_growth_no_scan_can_name_is_located_at_its_allocation(tmp_path, clean):
    a = audit("run", str(PROGRAM), "--steps", "10", "--device-memory", "0.0625", "--no-profile", "--quiet",
              out=tmp_path / "o", env={"HOOK_KEEP_CLEAN": "1" if clean else "0", "OMP_NUM_THREADS": "1"})
    assert a.returncode == 0, a.stderr[-2000:]
    if clean:
        assert not a.rule("memory-growth") and not a.rule("oom-risk")
        return
    line = next(n for n, t in enumerate(PROGRAM.read_text().splitlines(), 1) if "# ALLOCATES" in t)
    [f] = a.rule("memory-growth")
    assert [(loc["file"], loc["line"]) for loc in f["locations"]] == [(str(PROGRAM), line)]
    assert (f"The allocations made at hook_keep_cuda.py:{line} stay alive and grow at every step's end of the "
            "recorded allocator history (8.0 MiB more per step, ") in f["message"], f["message"]
    assert f["evidence"]["mib_per_step"] == 8.0
    # the forecast OOM names the same line as what keeps the live memory alive
    [oom] = a.rule("oom-risk")
    assert (f"What keeps the live memory alive is no name the graph scans reach: the allocations made at "
            f"hook_keep_cuda.py:{line} stayed alive, 8.0 MiB more at each step's end") in oom["message"], oom["message"]
    assert (oom["locations"][0]["file"], oom["locations"][0]["line"]) == (str(PROGRAM), line)


CLOSURE_KEEPS = """
import torch
from torch import nn


def watch(model):
    seen = []
    model[0].register_forward_hook(lambda mod, args, out: seen.append(out))  # FILLS


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
watch(model)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
for step in range(40):
    loss = model(torch.randn(512, 256)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.mark.slow
def test_a_variable_a_hooks_closure_keeps_is_named_with_its_function_and_line(tmp_path):
    """A forward hook's lambda appends each output, with its graph, to a list of the function that
    registered it: graph-leak and memory-growth name the list, its function and the lambda's line,
    where graph-leak said 'held by tensors outside the target module's globals' with no location."""
    script = tmp_path / "closure.py"
    script.write_text(CLOSURE_KEEPS)
    a = audit("run", str(script), "--steps", "10", "--no-profile", "--quiet", out=tmp_path / "o",
              env={"OMP_NUM_THREADS": "1"})
    assert a.returncode == 0, a.stderr[-2000:]
    line = next(n for n, t in enumerate(CLOSURE_KEEPS.splitlines(), 1) if "# FILLS" in t)
    [leak] = a.rule("graph-leak")
    assert (f"held by `seen` (a variable of `watch()` that a closure it made keeps, at closure.py:{line})."
            in leak["message"]), leak["message"]
    assert [(loc["file"], loc["line"]) for loc in leak["locations"]] == [(str(script), line)]
    [growth] = a.rule("memory-growth")
    assert [(loc["file"], loc["line"]) for loc in growth["locations"]] == [(str(script), line)]
    assert growth["evidence"]["holders"][0]["name"] == "seen"
    assert growth["message"].startswith("Memory grows over the steps: stop keeping old tensors. "
                                        "Tensors kept by the program grew by 16 MiB (2.00 MiB per step, at every "
                                        "scan)"), growth["message"]
