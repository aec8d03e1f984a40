"""The pin_memory fix and its advice agree: pageable-copy's patch pins the DataLoader and makes the
step's copies of its batches non_blocking=True, as its summary says (the patch used to pin only)."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from conftest import EXAMPLES, audit

QUIET_ENV = {"OMP_NUM_THREADS": "1"}


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_the_pin_memory_patch_makes_the_step_copies_non_blocking(tmp_path):
    trainer = tmp_path / "gpu_cuda_everywhere.py"
    shutil.copy(EXAMPLES / "gpu_cuda_everywhere.py", trainer)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    source = trainer.read_text().splitlines()
    loader_line = next(i for i, ln in enumerate(source, 1) if ln.startswith("loader = DataLoader("))
    copy_line = source.index("    x, y = x.cuda(), y.cuda()  # expect: pageable-copy") + 1
    # (on a loaded machine dataloader-bound may flag the loader too; its edit of the same lines goes
    # to numerics-fixes.patch and keeps these out of fixes.patch: the test is of pageable-copy alone)
    a = audit("run", f"{trainer.name}:step", "--steps", "4", "--no-profile", "--quiet", "--ignore", "dataloader-bound",
              out=tmp_path / "out", cwd=tmp_path, env=QUIET_ENV)
    assert a.returncode == 0, a.stderr
    [f] = a.rule("pageable-copy")
    assert "non_blocking=True" in f["fix"]["summary"]
    assert [(e["start"], e["end"]) for e in f["fix"]["edits"]] == [(loader_line, loader_line), (copy_line, copy_line)]
    subprocess.run(["git", "apply", str(a.out / "fixes.patch")], cwd=tmp_path, check=True)
    after = trainer.read_text().splitlines()
    assert after[loader_line - 1] == source[loader_line - 1].replace("drop_last=True)", "drop_last=True, pin_memory=True)")
    assert after[copy_line - 1] == "    x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)  # expect: pageable-copy"
    assert [i for i, (p, q) in enumerate(zip(source, after), 1) if p != q] == [loader_line, copy_line]
    b = audit("run", f"{trainer.name}:step", "--steps", "4", "--no-profile", "--quiet", out=tmp_path / "after",
              cwd=tmp_path, env=QUIET_ENV)
    assert b.returncode == 0, b.stderr
    assert not b.rule("pageable-copy")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_verify_proves_the_pin_and_non_blocking_patch(tmp_path):
    """The same patch re-run by --verify: pageable-copy's finding is gone and the weights are those
    of the unpatched run (pinning and non_blocking copies move the same bytes)."""
    trainer = tmp_path / "gpu_cuda_everywhere.py"
    shutil.copy(EXAMPLES / "gpu_cuda_everywhere.py", trainer)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    a = audit("run", f"{trainer.name}:step", "--steps", "4", "--no-profile", "--verify", "--ignore", "dataloader-bound",
              out=tmp_path / "out", cwd=tmp_path, env=QUIET_ENV)
    assert a.returncode == 0, a.stderr
    [f] = a.rule("pageable-copy")
    v = f["fix"]["verified"]
    assert v["status"] == "improved" and v["after"]["finding"] is False, (v, a.stdout)
    assert "weights identical to the unpatched run's" in v["note"], v
