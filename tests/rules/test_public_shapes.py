"""Issue #35 items 4 and 5 on CPU stand-ins of its public programs (tests/data/public_shapes):
where a fix is code the user would write it is a patch `--verify` proves, and each fix's text and
settings follow the finding's own cause.

x_transformers_enwik8.py (lucidrains/x-transformers train_enwik8.py's shape): the training loss
printed with `.item()` every step, `.cuda()` in `__getitem__`, rotary cos/sin recomputed by every
attention layer. makemore.py (karpathy/makemore's): `torch.cuda.synchronize()` that lets
`time.time()` time the step."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, audit

SHAPES = ROOT / "tests" / "data" / "public_shapes"


def _line(path: Path, text: str) -> int:
    return next(n for n, ln in enumerate(path.read_text().splitlines(), 1) if text in ln)


def _project(tmp: Path, name: str) -> Path:
    """The program alone in a fresh git repository, as a user's checkout."""
    tmp.mkdir(parents=True, exist_ok=True)
    shutil.copy(SHAPES / name, tmp / name)
    subprocess.run(["git", "init", "-q"], cwd=tmp, check=True)
    return tmp / name


@pytest.fixture(scope="module")
def enwik8(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("enwik8")
    prog = _project(tmp / "proj", "x_transformers_enwik8.py")
    a = audit("run", prog.name, "--no-profile", "--verify", out=tmp / "out", cwd=prog.parent)
    return prog, a


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_the_logging_item_and_the_getitem_copy_get_patches_verify_proves(enwik8, tmp_path):
    prog, a = enwik8
    assert a.returncode == 0, a.stderr[-3000:]
    print_line = _line(prog, 'print(f"training loss: {loss.item()}")')
    copy_line = _line(prog, "return full_seq.cuda()")
    [sync] = [f for f in a.rule("host-sync") if "phase" not in f["evidence"]]
    assert [loc["line"] for loc in sync["locations"]] == [print_line]
    assert sync["fix"]["edits"] == [{"file": str(prog), "start": print_line, "end": print_line,
                                     "lines": ["    if i % 50 == 0:", '        print(f"training loss: {loss.item()}")']}]
    [device] = a.rule("dataloader-on-device")
    moved = {e["start"]: e["lines"] for e in device["fix"]["edits"]}
    assert moved == {
        copy_line: ["        return full_seq"],
        _line(prog, "train_loader = cycle("): ["train_loader = cycle(DataLoader(train_dataset, batch_size=BATCH_SIZE, "
                                                 "drop_last=True, pin_memory=True))"],
        _line(prog, "val_loader = cycle("): ["val_loader = cycle(DataLoader(val_dataset, batch_size=BATCH_SIZE, "
                                             "drop_last=True, pin_memory=True))"],
        _line(prog, "loss = model(next(train_loader))"): ["    loss = model(next(train_loader).cuda(non_blocking=True))"],
        _line(prog, "loss = model(next(val_loader))"): ["            loss = model(next(val_loader).cuda(non_blocking=True))"],
        _line(prog, "random.choice(val_dataset)"): ["        inp = random.choice(val_dataset).cuda()[:-1]"],
    }
    for f in (sync, device):
        v = f["fix"]["verified"]
        assert v["status"] == "improved" and v["after"]["finding"] is False, v
        assert "weights identical to the unpatched run's" in v["note"], v
    assert "verify: 2 fix(es) in 1 re-run(s)" in a.stdout
    # the patch file a user applies: git takes it, the numerics one (nothing in it) is not written
    assert not (a.out / "numerics-fixes.patch").exists()
    assert "also: " in a.stdout and "numerics-fixes.patch" not in a.stdout
    work = _project(tmp_path / "apply", prog.name)
    subprocess.run(["git", "apply", str(a.out / "fixes.patch")], cwd=work.parent, check=True)
    after = work.read_text().splitlines()
    assert after[print_line - 1:print_line + 1] == ["    if i % 50 == 0:", '        print(f"training loss: {loss.item()}")']


@pytest.mark.slow
def test_launch_bound_on_rotary_ops_is_advised_for_them_not_for_a_loop_or_an_optimizer(enwik8):
    prog, a = enwik8
    [f] = a.rule("launch-bound")
    rotary = _line(prog, "return (t * freqs.cos() * scale)")
    assert f["locations"][0]["line"] == rotary
    summary = f["fix"]["summary"]
    assert "rotary cos/sin" in summary and "computed once and reused" in summary
    for wrong in ("foreach", "nn.LSTM", "per-element loop"):
        assert wrong not in summary, summary
    assert f["fix"]["config"] == {"torch.compile": {"mode": "reduce-overhead"}}


@pytest.mark.slow
def test_a_synchronize_that_times_the_step_is_advised_as_timing(tmp_path):
    prog = _project(tmp_path / "proj", "makemore.py")
    a = audit("run", prog.name, "--no-profile", "--verify", out=tmp_path / "out", cwd=prog.parent)
    assert a.returncode == 0, a.stderr[-3000:]
    [f] = a.rule("host-sync")
    sync_line = _line(prog, "        torch.cuda.synchronize()")
    [site] = f["evidence"]["sites"]
    assert (site["what"], site["line"], site["clock_read_at"]) == ("torch.cuda.synchronize", sync_line,
                                                                   _line(prog, "t1 = time.time()"))
    summary = f["fix"]["summary"]
    assert "remove explicit synchronize()" not in summary
    assert "Time with CUDA events" in summary and "every N steps" in summary
    # the settings belong to the finding: no logging interval for a synchronize, nothing "to verify"
    assert f["fix"]["config"] == {} and "log_every_n_steps" not in a.stdout
    # (nothing of host-sync's to verify: under load, a rehearsed fetch of this program can wait past
    # dataloader-bound's min-share, whose settings are then listed as not verifiable here)
    assert "\nverify: " in a.stdout and "host-sync" not in a.stdout.split("\nverify: ", 1)[1], a.stdout
    assert "verify: no fix to verify" in a.stdout or a.rule("dataloader-bound")
    assert not (a.out / "fixes.patch").exists() and not (a.out / "numerics-fixes.patch").exists()


@pytest.mark.slow
def test_an_item_returned_for_the_caller_is_not_advised_as_logging(tmp_path):
    """reinforce.py's `return action.item()`: the environment needs the action at once, so neither
    "log every N steps" nor a logging interval fits it."""
    prog = _project(tmp_path / "proj", "reinforce.py")
    a = audit("run", prog.name, "--no-profile", "--verify", out=tmp_path / "out", cwd=prog.parent)
    assert a.returncode == 0, a.stderr[-3000:]
    [f] = a.rule("host-sync")
    # (beside it, the Categorical's argument checks: one when it is made, one for log_prob's value)
    sites = {(s["what"], s["line"]) for s in f["evidence"]["sites"]}
    assert sites == {("Tensor.item", _line(prog, "return action.item()")),
                     ("torch.distributions argument check", _line(prog, "m = Categorical(probs)")),
                     ("torch.distributions argument check", _line(prog, "m.log_prob(action)"))}, sites
    summary = f["fix"]["summary"]
    assert summary.startswith("the program needs the value on the host at once, at every call (returned by the function")
    assert "log every N steps" not in summary and "log_every_n_steps" not in a.stdout
    assert f["fix"]["config"] == {"torch.distributions.Distribution.set_default_validate_args": False}
    # the patch turns the checks off; the returned action's fetch stays: counted on this CPU-only run
    # (no cost to compare), the finding remains with a third of its syncs, an improvement
    v = f["fix"]["verified"]
    assert v["status"] == "improved" and v["after"]["syncs_per_step"] == v["before"]["syncs_per_step"] / 3, v
