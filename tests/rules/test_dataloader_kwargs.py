"""DataLoader fixes are checked against what the call received at run time (the probe binds its
arguments): a keyword given through `**kwargs` (or by an expression) is never added again (a dict
literal the file builds and only unpacks gets it set in the literal), and
persistent_workers/prefetch_factor are never added to a call that keeps num_workers=0. The patched
program is run plainly: it must not raise."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from conftest import audit, patch_text

PROGRAM = '''\
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

torch.manual_seed(0)


class Slow(Dataset):
    """A slow source (a read, a decode): 5 ms a sample, 160 ms a batch, whatever the machine's
    load, so that even one worker cannot keep up with the step (a few ms)."""

    def __len__(self):
        return 1024

    def __getitem__(self, i):
        time.sleep(0.005)
        return torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(i)), i % 10


{setup}
loader = DataLoader(
    Slow(),
    batch_size=32,  # small batches
    {given}
)
model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 64 * 64, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step, (x, y) in enumerate(loader):
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step == 11:
        break
'''

CASES = {
    # the case: the accelerator's settings, {} on the CPU. The audit rehearses CUDA, where
    # kwargs gives num_workers=1: persistent_workers=True added beside it raised ValueError in the
    # plain CPU run
    "kwargs-accelerator": ('kwargs = {"num_workers": 1, "pin_memory": True} if torch.cuda.is_available() else {}',
                           "**kwargs,"),
    # the mapping gives num_workers=0: adding num_workers= raised "got multiple values"; the patch
    # sets it in the dict literal instead
    "kwargs-workers": ('kwargs = {"num_workers": 0}', "**kwargs,"),
    # pytorch/examples mnist_rnn's shape: the mapping is empty in this run and gives num_workers in
    # another (its --accel flag); keywords added beside `**kwargs` raised "got multiple values" there
    "kwargs-empty-here": ('kwargs = {"num_workers": 1, "pin_memory": True} if "--accel" in sys.argv else {}',
                          "**kwargs,"),
    # num_workers from the config (left to the user): persistent_workers=True alone raised ValueError
    "config-workers": ('cfg = {"workers": 0}', 'num_workers=cfg["workers"],'),
    # named as a literal: changed in place, and what it enables added on a line of its own
    "literal-workers": ("", "num_workers=0,"),
}


def _project(folder, case):
    """PROGRAM with CASE's setup alone in a fresh git repository, as a user's checkout."""
    setup, given = CASES[case]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prog.py").write_text(PROGRAM.format(setup=setup, given=given))
    subprocess.run(["git", "init", "-q"], cwd=folder, check=True)
    return folder


def _audit(folder, *flags):
    # 12 steps: after the profiled ones (slow under load) a worker has its prefetched batches ready,
    # and the unprofiled steps after them must still show the waits (with --steps 6, 3 of 3 could not)
    a = audit("run", "prog.py", "--steps", "12", "--quiet", *flags, out=folder / "out", cwd=folder)
    assert a.returncode == 0, a.stderr
    return a


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    """The kwargs-workers case audited once with --verify: its case test reads the patch it wrote,
    and the verify test what its re-run with that patch measured."""
    return _audit(_project(tmp_path_factory.mktemp("verified"), "kwargs-workers"), "--verify")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
@pytest.mark.parametrize("case", list(CASES))
def test_the_patched_dataloader_call_runs(tmp_path, case, request):
    folder = _project(tmp_path, case)
    a = request.getfixturevalue("verified") if case == "kwargs-workers" else _audit(folder)
    [f] = a.rule("dataloader-bound")
    patch = patch_text(a.out / "fixes.patch")
    changed = [ln for ln in patch.splitlines() if ln[:1] in ("+", "-") and ln[:3] not in ("+++", "---")]
    summary = f["fix"]["summary"]
    if case == "literal-workers":
        workers = f["fix"]["config"]["DataLoader.num_workers"]
        assert changed == ["-    num_workers=0,", f"+    num_workers={workers},", "+    persistent_workers=True,"], patch
    elif case == "kwargs-empty-here":
        # merged into the mapping: the call gets each keyword once in either configuration
        workers = f["fix"]["config"]["DataLoader.num_workers"]
        assert changed == ["-    **kwargs,", f"+    **dict(kwargs, num_workers={workers}, persistent_workers=True),"], patch
        assert "The call also unpacks `**kwargs`, which gave none of the patch's keywords in this run" in summary
    elif case == "kwargs-workers":
        # a dict literal the file builds and only unpacks: num_workers is set in it, and what needs
        # it beside it in the call
        workers = f["fix"]["config"]["DataLoader.num_workers"]
        assert changed == ['-kwargs = {"num_workers": 0}',
                           f'+kwargs = {{"num_workers": {workers}, "persistent_workers": True}}'], patch
        assert (f"The patch sets num_workers={workers}, persistent_workers=True in the dict the call unpacks "
                "(`**kwargs`, line ") in summary
    else:
        # num_workers reaches the call through the mapping or the config: neither it nor what needs
        # it is added (the summary says where to set them)
        assert not any(k in patch for k in ("num_workers=", "persistent_workers", "prefetch_factor")), patch
        assert "which the call takes from `" in summary or "num_workers from `" in summary, summary
        assert ("`**kwargs`" if "kwargs" in case else '`cfg["workers"]`') in summary, summary
    if case == "kwargs-accelerator":
        assert f["evidence"]["settings"]["num_workers"] == 1 and a.evidence["environment"]["rehearsal"]
        assert a.evidence["dataloaders"][0]["passed"] == ["batch_size", "dataset", "num_workers", "pin_memory"]
    if not patch:  # no patch: the program is the user's own, as the audit left it (unchanged), which it ran
        setup, given = CASES[case]
        assert (folder / "prog.py").read_text() == PROGRAM.format(setup=setup, given=given)
        return
    # (applied to this test's own copy of the program: the shared audit's is read, never written)
    subprocess.run(["git", "apply", str(a.out / "fixes.patch")], cwd=folder, check=True)
    for args in ([], ["--accel"]) if case == "kwargs-empty-here" else ([],):  # (its other configuration too)
        run = subprocess.run([sys.executable, "prog.py", *args], cwd=folder, capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_num_workers_set_in_the_dict_the_call_unpacks_is_proven_by_verify(verified):
    """pytorch/examples' shape (`train_kwargs = {...}`, `DataLoader(ds, **train_kwargs)`): the patch
    sets num_workers in the dict, and --verify re-runs the program with it: the wait for data is
    gone or fell by a quarter or more."""
    a = verified
    [f] = a.rule("dataloader-bound")
    assert [e["lines"] for e in f["fix"]["edits"]][0] == [
        f'kwargs = {{"num_workers": {f["fix"]["config"]["DataLoader.num_workers"]}, "persistent_workers": True}}']
    v = f["fix"]["verified"]
    assert v["status"] == "improved", (v, a.stdout)
    assert "with its own edit, which changes results" in v["note"]
