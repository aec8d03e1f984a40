"""CUDA rehearsal of checkpoints: `torch.save`/`torch.load` of GPU tensors behave as on a GPU (issue 25,
item 11), and the files written stay what the program's CPU version writes."""
from __future__ import annotations

import hashlib
import json
import runpy
import sys

import pytest
import torch

from conftest import audit

if torch.cuda.is_available():  # pragma: no cover - rehearsal is for machines without a GPU
    pytest.skip("a CUDA device is present: nothing to rehearse", allow_module_level=True)

# A nanoGPT-shaped resume and its neighbours. Each case ends by writing what it saw to result.json:
# the devices the program is told, and whether the first training step after the load ran.
PROGRAM = r'''
import json, os, sys
import torch
import torch.nn as nn

device = sys.argv[2] if len(sys.argv) > 2 else "cuda"
gpu_file = sys.argv[3] if len(sys.argv) > 3 else None


def run(case):
    torch.manual_seed(0)
    model = nn.Linear(8, 4).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(16, 8, device=device)).sum().backward()
    opt.step()
    opt.zero_grad()
    seen = {}
    if case == "resume":  # nanoGPT: checkpoint = torch.load(ckpt_path, map_location=device)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, "ckpt.pt")
        checkpoint = torch.load("ckpt.pt", map_location=device)
        seen["loaded"] = str(checkpoint["model"]["weight"].device)
        model = nn.Linear(8, 4).to(device)
        model.load_state_dict(checkpoint["model"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        opt.load_state_dict(checkpoint["optimizer"])
    elif case == "whole":  # the whole model pickled and read back
        torch.save(model, "model.pt")
        model = torch.load("model.pt", weights_only=False)
        seen["loaded"] = str(next(model.parameters()).device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif case == "file_object":  # pytorch/examples word_language_model: saved and read back through open()
        with open("model.pt", "wb") as f:
            torch.save(model, f)
        with open("model.pt", "rb") as f:
            model = torch.load(f, weights_only=False)
        seen["loaded"] = str(next(model.parameters()).device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif case == "state":  # a state dict read back without map_location: it comes back on the GPU
        torch.save(model.state_dict(), "sd.pt")
        ema = {k: v.clone() for k, v in torch.load("sd.pt").items()}
        seen["loaded"] = str(ema["weight"].device)
    elif case == "to_cpu":  # map_location="cpu": host tensors, as on a GPU
        torch.save(model.state_dict(), "sd.pt")
        seen["loaded"] = str(torch.load("sd.pt", map_location="cpu")["weight"].device)
    elif case == "gpu_file":  # written on a real GPU (location cuda:0), read without map_location
        seen["loaded"] = str(torch.load(gpu_file)["weight"].device)
    for i in range(3):
        x = torch.randn(16, 8, device=device)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if case == "state":
            with torch.no_grad():
                for k, p in model.state_dict().items():
                    ema[k].mul_(0.9).add_(p, alpha=0.1)
    seen["trained"] = True
    torch.save(model.state_dict(), f"final-{case}.pt")
    return seen


json.dump({case: run(case) for case in sys.argv[1].split(",")}, open("result.json", "w"))
'''


def _gpu_file(path) -> None:
    """A state dict as a GPU run writes it: its storages' location is cuda:0."""
    import torch.serialization as ts

    orig = ts.location_tag
    ts.location_tag = lambda storage: "cuda:0"
    try:
        torch.save(torch.nn.Linear(8, 4).state_dict(), path)
    finally:
        ts.location_tag = orig


CASES = "resume,whole,file_object,state,to_cpu,gpu_file"


@pytest.fixture(scope="module")
def rehearsed(tmp_path_factory):
    """Every case rehearsed in one audited program (each case seeds its own run and writes its own
    files, so none sees another's): the folder it ran in, and the audit."""
    d = tmp_path_factory.mktemp("rehearsed")
    (d / "train.py").write_text(PROGRAM)
    _gpu_file(d / "gpu.pt")
    a = audit("run", str(d / "train.py"), "--to-end", "--no-profile", "--quiet", "--", CASES, "cuda", str(d / "gpu.pt"),
              out=d / "out", cwd=d)
    return d, a


@pytest.mark.slow
def test_checkpoints_load_back_as_on_a_gpu(rehearsed):
    d, a = rehearsed
    assert a.returncode == 0, a.stderr
    assert "rehearsing" in a.stderr
    seen = json.loads((d / "result.json").read_text())
    assert seen == {case: {"loaded": loaded, "trained": True}
                    for case, loaded in [("resume", "cuda:0"), ("whole", "cuda:0"), ("file_object", "cuda:0"), ("state", "cuda:0"),
                                         ("to_cpu", "cpu"), ("gpu_file", "cuda:0")]}


@pytest.mark.slow
def test_a_rehearsed_checkpoint_is_the_file_the_cpu_version_writes(rehearsed, tmp_path, monkeypatch):
    """The resume round trip under rehearsal writes the bytes the program's CPU version writes (the
    file is for this machine too), and trains to the same weights. The CPU version runs here, in the
    test's process (the same program, as `python train.py resume cpu` runs it)."""
    d, a = rehearsed
    assert a.returncode == 0, a.stderr
    (tmp_path / "train.py").write_text(PROGRAM)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py", "resume", "cpu"])
    runpy.run_path(str(tmp_path / "train.py"), run_name="__main__")
    assert json.loads((tmp_path / "result.json").read_text()) == {"resume": {"loaded": "cpu", "trained": True}}
    for name in ("ckpt.pt", "final-resume.pt"):
        digest = {run: hashlib.sha256((folder / name).read_bytes()).hexdigest()
                  for run, folder in (("cpu", tmp_path), ("rehearsed", d))}
        assert digest["cpu"] == digest["rehearsed"], name
