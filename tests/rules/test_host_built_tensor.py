"""Issue #80 item 3: host-built-tensor, a tensor built on the host every step and copied to the GPU.

gan_tutorial.py has the shape of yunjey/pytorch-tutorial's GAN (`torch.ones(batch_size, 1).to(device)`,
`torch.randn(batch_size, latent_size).to(device)` in the loop); legacy_gan.py that of PyTorch-GAN
(`Tensor(np.random.normal(0, 1, (n, d)))`). The constants' patch keeps the weights bit for bit; the
draws' patch says the numbers change (the device's generator) and is marked so in fixes.patch."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from auditor.rules._support.host_built import host_built
from conftest import ROOT, audit

if torch.cuda.is_available():  # pragma: no cover - these programs are rehearsed
    pytest.skip("a CUDA device is present: nothing to rehearse", allow_module_level=True)

SHAPES = ROOT / "tests" / "data" / "public_shapes"


def marked(path: Path, marker: str) -> int:
    return next(i for i, t in enumerate(path.read_text().splitlines(), 1) if t.endswith(f"# {marker}"))


def _project(tmp: Path, name: str) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    shutil.copy(SHAPES / name, tmp / name)
    subprocess.run(["git", "init", "-q"], cwd=tmp, check=True)
    return tmp / name


def _runs_plainly(prog: Path) -> None:
    p = subprocess.run([sys.executable, prog.name], cwd=prog.parent, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ""})
    assert p.returncode == 0, p.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_labels_and_noise_built_on_the_host_are_made_on_the_device(tmp_path):
    prog = _project(tmp_path / "proj", "gan_tutorial.py")
    a = audit("run", prog.name, "--steps", "8", "--no-profile", "--no-numerics", "--verify", out=tmp_path / "out",
              cwd=prog.parent)
    assert a.returncode == 0, a.stdout[-3000:]
    constants, draws = a.rule("host-built-tensor")
    ones, zeros, noise, split = (marked(prog, m) for m in ("ONES LINE", "ZEROS LINE", "NOISE LINE", "SPLIT LINE"))
    assert constants["message"] == ("Constants are built on the CPU: make them on the GPU. "
                                    f"2 constants per step built on the host and copied to the GPU: torch.ones at "
                                    f"line {ones}, torch.zeros at line {zeros}.")
    assert draws["message"] == ("Random draws are made on the CPU: draw them on the GPU. "
                                f"2 random draws per step built on the host and copied to the GPU: torch.randn at "
                                f"line {noise}, torch.randn at line {split}.")
    # the split draw is copied a line later, and named there and where it is made
    assert [(s["line"], s["made_at"]) for s in draws["evidence"]["sites"]] == [(noise, noise), (split + 1, split)]
    assert constants["fix"]["edits"] == [
        {"file": str(prog), "start": ones, "end": ones,
         "lines": ["        real_labels = torch.ones(batch_size, 1, device=device)  # ONES LINE"]},
        {"file": str(prog), "start": zeros, "end": zeros,
         "lines": ["        fake_labels = torch.zeros(batch_size, 1, device=device)  # ZEROS LINE"]}]
    assert [e["lines"] for e in draws["fix"]["edits"]] == [
        ["        z = torch.randn(batch_size, latent_size, device=device)  # NOISE LINE"],
        ["        z = torch.randn(batch_size, latent_size, device=device)  # SPLIT LINE"]]
    # a blocking copy each: costed as the sync torch makes after it, a lower bound
    assert constants["cost"]["measured"] is False and "2 blocking host-to-device copy(s)/step" in constants["cost"]["note"]
    assert constants["fix"]["changes_numerics"] is False and draws["fix"]["changes_numerics"] is True
    assert "device's generator: its numbers differ from the host draw's" in draws["fix"]["summary"]
    assert "values stay exactly what they were" in constants["fix"]["summary"]
    v = constants["fix"]["verified"]
    assert v["status"] == "improved" and "weights identical to the unpatched run's" in v["note"], v
    assert draws["fix"]["verified"]["status"] == "improved", draws["fix"]["verified"]
    # neither copy is pageable-copy's to pin: the fix is not to copy at all
    assert not a.rule("pageable-copy")
    # one patch with both, the draws marked as changing results
    whole = (a.out / "fixes.patch").read_text()
    held = [ln for ln in whole.splitlines() if ln.startswith("#   host-built-tensor ")]
    assert len(held) == 2 and sum("[changes results: review it]" in ln for ln in held) == 1, whole
    # each finding's own patch (findings.json) applies alone, and so does fixes.patch: the
    # program still runs
    original = prog.read_text()
    for patch in (constants["fix"]["patch"], draws["fix"]["patch"], whole):
        prog.write_text(original)
        subprocess.run(["git", "apply", "-"], input=patch, text=True, cwd=prog.parent, check=True)
        _runs_plainly(prog)
    # the program as patched: silent
    b = audit("run", prog.name, "--steps", "8", "--no-profile", "--no-numerics", out=tmp_path / "after",
              cwd=prog.parent)
    assert b.returncode == 0 and not b.rule("host-built-tensor"), b.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_a_numpy_draw_into_a_legacy_cuda_type_is_drawn_by_the_type(tmp_path):
    prog = _project(tmp_path / "proj", "legacy_gan.py")
    a = audit("run", prog.name, "--steps", "6", "--no-profile", "--no-numerics", out=tmp_path / "out",
              cwd=prog.parent)
    assert a.returncode == 0, a.stdout[-3000:]
    [draws] = a.rule("host-built-tensor")
    noise, labels = marked(prog, "NOISE LINE"), marked(prog, "LABELS LINE")
    assert [(s["made_by"], s["line"]) for s in draws["evidence"]["sites"]] == [
        ("np.random.normal", noise), ("np.random.randint", labels)]
    assert [e["lines"] for e in draws["fix"]["edits"]] == [
        ["        z = Variable(Tensor(imgs.shape[0], 8).normal_(0, 1))  # NOISE LINE"],
        ["        gen_labels = Variable(LongTensor(imgs.shape[0]).random_(0, 4))  # LABELS LINE"]]
    # the labels made from sizes and filled on the device (`Tensor(n, 1).fill_(1.0)`) are not host-built
    assert marked(prog, "VALID LINE") not in {loc["line"] for loc in draws["locations"]}
    subprocess.run(["git", "apply", str(a.out / "fixes.patch")], cwd=prog.parent, check=True)
    _runs_plainly(prog)


def test_a_tensor_built_once_before_the_loop_is_not_rebuilt_every_step(tmp_path):
    f = tmp_path / "t.py"
    f.write_text("import torch\nconst = torch.ones(4)\nfor i in range(3):\n    x = const.to('cuda')\n"
                 "    y = torch.randn(4, generator=g).to('cuda')\n    w = torch.ones(4).to('cuda', torch.float16)\n"
                 "    z = torch.zeros(2)\n    z = z.to('cuda')\n")
    assert host_built(str(f), 4) is None  # built once, before the loop: not this rule's
    made = host_built(str(f), 5)  # a host generator cannot draw for the device: named, not patched
    assert (made.made, made.random, made.edit) == ("torch.randn", True, None)
    assert host_built(str(f), 6).edit is None  # (the copy also converts: left alone)
    made = host_built(str(f), 8)
    assert (made.made, made.line, made.edit.lines) == ("torch.zeros", 7, ["    z = torch.zeros(2, device='cuda')"])
