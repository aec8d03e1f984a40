"""memory-growth names a line in the user's code: the line that fills the holder the graph scans
found, else, when no name they reach holds the memory (a list a hook's closure keeps), the line
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
