"""At an out-of-memory error, what keeps the live memory alive is named: the holder, the line that
fills it and the bytes it holds, from the graph and tensor scans the run makes. A CUDA program
rehearsed on the CPU with a small `--device-memory` records its device's requests itself, forecasts
the step where the device would be full, and names the holder there; a program that dies of an
error inside its training function has the locals of that function scanned."""
from __future__ import annotations

import pytest

from conftest import ROOT, audit

DATA = ROOT / "tests" / "data"
LEAK = DATA / "preds_leak_cuda.py"
MiB = 1 << 20


def _line(mark: str) -> int:
    return next(n for n, text in enumerate(LEAK.read_text().splitlines(), 1) if mark in text)


@pytest.mark.slow
def test_a_rehearsed_leak_forecasts_its_oom_step_and_names_the_holder(tmp_path):
    a = audit("run", str(LEAK), "--steps", "8", "--device-memory", "0.125", "--no-profile", "--quiet",
              out=tmp_path / "leak")
    assert a.returncode == 0, a.stderr[-2000:]
    fill = _line("FILL LINE")
    [oom] = a.rule("oom-risk")
    assert oom["title"] == "CUDA out of memory (forecast by the rehearsal)"
    assert oom["message"].startswith("The GPU would run out of memory"), oom["message"]
    assert (". Forecast by the CUDA rehearsal (--device-memory): the program would run out of GPU memory in step 3. "
            "CUDA out of memory on cuda:0: ") in oom["message"], oom["message"]
    # 16 MiB of output a step (1024 x 4096 float32), kept by `preds`: four after step 3 (scanned
    # because it came near the device's memory)
    assert (f"What keeps the live memory alive: `preds` (list, filled at preds_leak_cuda.py:{fill}) holds 64.0 MiB in 4 "
            "tensors after step 3, 16.0 MiB more per step since step 1.") in oom["message"], oom["message"]
    assert (oom["locations"][0]["file"], oom["locations"][0]["line"]) == (str(LEAK), fill)
    h = oom["evidence"]["holder"]
    assert (h["name"], h["bytes"], h["tensors"], h["line"], h["after_step"]) == ("preds", 64 * MiB, 4, fill, 3)
    assert oom["evidence"]["forecast_step"] == 3
    # the steps' device memory is the rehearsed device's: 16 MiB more at each step's end
    steps = a.evidence["steps"]
    assert [b["device_allocated"] - s["device_allocated"] for s, b in zip(steps, steps[1:])] == [16 * MiB] * 7
    [growth] = a.rule("memory-growth")
    assert growth["message"].startswith("Memory grows over the steps: stop keeping old tensors. "
                                        "GPU memory (the requests this CUDA rehearsal recorded"), growth["message"]
    assert growth["evidence"]["mib_per_step"] == 16.0
    assert [(loc["file"], loc["line"]) for loc in growth["locations"]] == [(str(LEAK), fill)]
    assert not a.rule("allocator-churn")  # (the forecast's OOMs are oom-risk's; no retry was forecast)
    [leak] = a.rule("graph-leak")
    assert [(loc["file"], loc["line"]) for loc in leak["locations"]] == [(str(LEAK), fill)]

    clean = audit("run", str(LEAK), "--steps", "8", "--device-memory", "0.125", "--no-profile", "--quiet",
                  out=tmp_path / "clean", env={"PREDS_LEAK_CLEAN": "1"})
    assert clean.returncode == 0, clean.stderr[-2000:]
    assert not clean.rule("oom-risk") and not clean.rule("memory-growth") and not clean.rule("graph-leak")


DIES = '''
import torch
from torch import nn


def train():
    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    outputs = []
    for step in range(10):
        x = torch.randn(512, 256)
        if step == 3:  # the device is full: the forward's first request fails
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        out = model(x)
        loss = out.square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        outputs.append(out)  # FILL LINE


train()
'''


@pytest.mark.slow
def test_a_program_that_dies_in_its_training_function_has_its_locals_scanned(tmp_path):
    """The error leaves `train()`; its traceback still holds the function's locals, and the scan
    after the failed step names the list there (the live stack no longer has it)."""
    script = tmp_path / "dies.py"
    script.write_text(DIES)
    a = audit("run", str(script), "--steps", "8", "--no-profile", "--quiet", out=tmp_path / "o")
    assert a.returncode != 0
    [failed] = [s for s in a.evidence["graph_scans"] if s["failed"]]
    assert failed["after_step"] == 2  # (the error fell before step 3 began: after step 2)
    held = {h["name"]: h for h in failed["holders"]}
    h = held["outputs"]
    line = next(n for n, t in enumerate(DIES.splitlines(), 1) if "FILL LINE" in t)
    assert h["function"] == "train" and h["tensors"] == 3 and h["bytes"] == 3 * 512 * 256 * 4
    assert (h["where"]["file"], h["where"]["line"]) == (str(script), line)


LOCAL_LEAK = '''
import torch
from torch import nn


def train():
    torch.manual_seed(0)
    model = nn.Linear(256, 4096).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    outputs = []
    for step in range(10):
        x = torch.randn(512, 256, device="cuda")
        out = model(x)
        loss = out.square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        outputs.append(out)  # FILL LINE


train()
'''


@pytest.mark.slow
def test_a_rehearsed_leak_in_a_local_names_the_local_and_its_function(tmp_path):
    """Most training loops live in functions: the OOM forecast names the local that keeps the
    outputs (8 MiB a step), its function and the line that fills it."""
    script = tmp_path / "local_leak.py"
    script.write_text(LOCAL_LEAK)
    a = audit("run", str(script), "--steps", "8", "--device-memory", "0.0625", "--no-profile", "--quiet",
              out=tmp_path / "o")
    assert a.returncode == 0, a.stderr[-2000:]
    line = next(n for n, t in enumerate(LOCAL_LEAK.splitlines(), 1) if "FILL LINE" in t)
    [oom] = a.rule("oom-risk")
    assert (f"What keeps the live memory alive: `outputs` (list, a local of `train()`, filled at local_leak.py:{line}) "
            "holds 48.0 MiB in 6 tensors after step 5, 8.0 MiB more per step since step 1.") in oom["message"], \
        oom["message"]
    assert (oom["locations"][0]["file"], oom["locations"][0]["line"]) == (str(script), line)
    h = oom["evidence"]["holder"]
    assert (h["name"], h["function"], h["bytes"], h["tensors"]) == ("outputs", "train", 48 * MiB, 6)
