"""What a program does to its own process, under the audit as in a plain run: its own profile
function (sys.setprofile) stays in place through the profiler window; its own trace function
(sys.settrace, a coverage tool's, a debugger's) sees a few hundred of the audit's frames, not tens
of thousands; closing every descriptor it did not open (os.closerange(3, 65536), as a daemonising
program does) leaves the audit reporting; training on a thread while the main thread joins it has
its steps found. Each trains the same weights audited as plain."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import auditor
from conftest import audit

TRAIN = '''
import json, os, sys, threading
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
data = [torch.randn(4, 8) for _ in range(12)]
seen = {"calls": 0, "auditor": 0, "per_step": []}
WHAT = sys.argv[2]
AUDITOR = sys.argv[3]  # (the audit's package directory: a checkout's venv may sit inside one named "auditor")


def profile(frame, event, arg):
    if event == "call":
        seen["calls"] += 1


def trace(frame, event, arg):
    if event == "call":
        seen["calls"] += 1
        if frame.f_code.co_filename.startswith(AUDITOR):
            seen["auditor"] += 1
        names[frame.f_code.co_name] = names.get(frame.f_code.co_name, 0) + 1  # (a dict that grows)


names = {}


def train():
    for i, x in enumerate(data):
        before = seen["calls"]
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        if WHAT == "setprofile":
            assert sys.getprofile() is profile, f"step {i}: the profile function is {sys.getprofile()!r}"
            seen["per_step"].append(seen["calls"] - before)


if WHAT == "closerange":
    os.closerange(3, 65536)
if WHAT == "setprofile":
    sys.setprofile(profile)
if WHAT == "settrace":
    sys.settrace(trace)
if WHAT == "thread":
    t = threading.Thread(target=train)
    t.start()
    t.join()
else:
    train()
sys.setprofile(None)
sys.settrace(None)
with open(sys.argv[1], "w") as f:
    json.dump({"weights": [p.tolist() for p in model.parameters()], **seen}, f)
'''


def plain_and_audited(tmp_path: Path, what: str, *flags: str):
    prog = tmp_path / "train.py"
    prog.write_text(TRAIN)
    package = str(Path(auditor.__file__).resolve().parent) + os.sep
    p = subprocess.run([sys.executable, str(prog), str(tmp_path / "plain.json"), what, package], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    a = audit("run", str(prog), "--steps", "6", "--to-end", "-q", *flags, "--",
              str(tmp_path / "audited.json"), what, package, out=tmp_path / "out", cwd=tmp_path)
    plain = json.loads((tmp_path / "plain.json").read_text())
    audited = json.loads((tmp_path / "audited.json").read_text()) if (tmp_path / "audited.json").exists() else None
    return a, plain, audited


def test_the_programs_own_profile_function_stays_through_the_window(tmp_path: Path) -> None:
    """torch's stack tracer installs its own profile function on every thread for the window: the
    window records no Python stacks where the program has one, and says so."""
    a, plain, audited = plain_and_audited(tmp_path, "setprofile", "--no-numerics")
    assert a.returncode == 0, a.stderr[-3000:]
    assert audited["weights"] == plain["weights"]
    assert len(audited["per_step"]) == 12 and min(audited["per_step"]) > 0  # (it ran in every step)
    assert a.evidence["profile"]["steps"]  # (the window was recorded)
    assert any("sys.setprofile" in n for n in a.evidence["environment"]["notes"])


def test_the_programs_own_trace_function_sees_few_of_the_audits_frames(tmp_path: Path) -> None:
    """Measured on this program (12 steps, the numerics checks on): 129,707 calls, 45,975 of them in
    the audit's files, the rest mostly the standard library's functions they called (an ast walk of
    torch's profiler source, a realpath per file, a walk of every closure's file), against 1,251 in a
    plain run; now about 1,240 of the audit's, ~90 a step (its probes and hooks). The trace
    function also adds names to a dict of its own: the audit's scans, which walk the program's
    dicts, must not fail on it (they did: "dictionary changed size during iteration", exit 3)."""
    a, plain, audited = plain_and_audited(tmp_path, "settrace")
    assert a.returncode == 0, a.stderr[-3000:]
    assert audited["weights"] == plain["weights"]
    assert audited["auditor"] < 2000 and audited["calls"] < 10 * plain["calls"], (audited["auditor"], audited["calls"], plain["calls"])


def test_a_program_that_closes_every_descriptor_is_still_audited(tmp_path: Path) -> None:
    """The evidence pipe is one of them: the audit exited 3 with its own traceback (a plain run: 0)."""
    a, plain, audited = plain_and_audited(tmp_path, "closerange", "--no-numerics")
    assert a.returncode == 0, a.stderr[-3000:]
    assert "Traceback" not in a.stderr
    assert audited["weights"] == plain["weights"]
    assert len(a.evidence["steps"]) == 12 and a.evidence["ending"]["status"] == "completed"


def test_steps_on_a_thread_the_main_thread_joins_are_found(tmp_path: Path) -> None:
    a, plain, audited = plain_and_audited(tmp_path, "thread", "--no-numerics")
    assert a.returncode == 0, a.stderr[-3000:]
    assert audited["weights"] == plain["weights"]
    assert len(a.evidence["steps"]) == 12 and a.evidence["program"]["steps_by"] == "optimizer"
    assert a.evidence["profile"]["steps"]


def test_the_audit_ends_a_thread_trained_program_after_its_steps(tmp_path: Path) -> None:
    """--steps 4 without --to-end: the training thread stops at the boundary, as the audit stops a
    program's main thread, with no traceback of the audit's interrupt on stderr."""
    prog = tmp_path / "train.py"
    prog.write_text(TRAIN)
    a = audit("run", str(prog), "--steps", "4", "--no-numerics", "-q", "--", str(tmp_path / "a.json"), "thread",
              out=tmp_path / "out", cwd=tmp_path)
    assert a.returncode == 0, a.stderr[-3000:]
    assert len(a.evidence["steps"]) == 4 and "StepsDone" not in a.stderr and "Traceback" not in a.stderr
    assert a.evidence["program"]["ended_by_audit"]
