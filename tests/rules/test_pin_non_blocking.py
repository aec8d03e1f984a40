"""The pin_memory fix and its advice agree: pageable-copy's patch pins the DataLoader and makes the
step's copies of its batches non_blocking=True, as its summary says (the patch used to pin only).

One audit with --verify serves both tests: the patch it writes is the one a user applies (checked
line by line here), and its re-run of the program with that patch applied, audited again in full,
is the audit of the patched program (pageable-copy gone, the same weights)."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from conftest import EXAMPLES, audit

QUIET_ENV = {"OMP_NUM_THREADS": "1"}
COPY = "    x, y = x.cuda(), y.cuda()  # expect: pageable-copy"


def _project(folder):
    """examples/gpu_cuda_everywhere.py alone in a fresh git repository, as a user's checkout."""
    folder.mkdir(parents=True, exist_ok=True)
    trainer = folder / "gpu_cuda_everywhere.py"
    shutil.copy(EXAMPLES / "gpu_cuda_everywhere.py", trainer)
    subprocess.run(["git", "init", "-q"], cwd=folder, check=True)
    return trainer


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    """The example audited with --verify (4 steps): the audit, and its one pageable-copy finding."""
    tmp = tmp_path_factory.mktemp("pin")
    trainer = _project(tmp / "proj")
    # (on a loaded machine dataloader-bound may flag the loader too; its edit of the same line would
    # be taken in fixes.patch instead: the tests are of pageable-copy alone)
    a = audit("run", f"{trainer.name}:step", "--steps", "4", "--no-profile", "--verify", "--ignore", "dataloader-bound",
              out=tmp / "out", cwd=trainer.parent, env=QUIET_ENV)
    assert a.returncode == 0, a.stderr
    [f] = a.rule("pageable-copy")
    return a, f


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_the_pin_memory_patch_makes_the_step_copies_non_blocking(verified, tmp_path):
    a, f = verified
    trainer = _project(tmp_path)
    source = trainer.read_text().splitlines()
    loader_line = next(i for i, ln in enumerate(source, 1) if ln.startswith("loader = DataLoader("))
    copy_line = source.index(COPY) + 1
    assert "non_blocking=True" in f["fix"]["summary"]
    assert [(e["start"], e["end"]) for e in f["fix"]["edits"]] == [(loader_line, loader_line), (copy_line, copy_line)]
    subprocess.run(["git", "apply", str(a.out / "fixes.patch")], cwd=tmp_path, check=True)
    after = trainer.read_text().splitlines()
    assert after[loader_line - 1] == source[loader_line - 1].replace("drop_last=True)", "drop_last=True, pin_memory=True)")
    assert after[copy_line - 1] == "    x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)  # expect: pageable-copy"
    assert [i for i, (p, q) in enumerate(zip(source, after), 1) if p != q] == [loader_line, copy_line]
    # the patched program, audited again (--verify's re-run of the fixes that keep results): no pageable-copy
    v = f["fix"]["verified"]
    assert v["note"].startswith("with the fixes that keep results: the finding is gone") and v["after"]["finding"] is False, v


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_verify_proves_the_pin_and_non_blocking_patch(verified):
    """The same patch re-run by --verify: pageable-copy's finding is gone and the weights are those
    of the unpatched run (pinning and non_blocking copies move the same bytes)."""
    a, f = verified
    v = f["fix"]["verified"]
    assert v["status"] == "improved" and v["after"]["finding"] is False, (v, a.stdout)
    assert "weights identical to the unpatched run's" in v["note"], v
