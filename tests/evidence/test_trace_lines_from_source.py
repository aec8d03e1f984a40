"""Lines from a plain recording: a trace names a Python frame by its def line, or, for a frame
running when the profiler started (a loop at module level or in main()), by the line it was on
then. The op's line is read from the frame's source: the one line of the function that can make
that op, the few that can ("one of lines ..."), or none: the frame without a line. Never a precise
wrong line."""
from __future__ import annotations

import re

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import EXAMPLES, FIXTURES, ROOT, audit
from auditor.evidence.trace.load import load_trace

LOOP = ROOT / "tests" / "data" / "recorded_module_loop.py"
SOURCE = LOOP.read_text()


def marked(marker: str) -> int:
    return next(i for i, line in enumerate(SOURCE.splitlines(), 1) if line.endswith(f"# {marker}"))


@pytest.fixture(scope="module")
def loop_trace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("module_loop")
    (root / "loop.py").write_text(SOURCE)
    subprocess.run([sys.executable, "loop.py"], cwd=root, capture_output=True, text=True, timeout=120, check=True)
    return root


def frames_of(trace, name: str) -> set[tuple[int, tuple[int, ...], str]]:
    rows = [r for r in range(len(trace.events)) if trace.name(r) == name or trace.name(r).startswith(name)]
    assert rows, name
    return {(f.line, getattr(f, "lines", ()), type(f).__name__) for f in map(trace.user_frame, rows)}


def test_ops_of_a_module_level_loop_are_placed_at_the_lines_that_make_them(loop_trace, monkeypatch):
    """Every op of the loop was placed at `prof.step()`, the line the module's frame was on when
    the profiler started (the issue's three syncs at `if torch.isnan(loss):`, `logits[y > 0.5]` and
    `.cpu()`, and a `loss.item()` in an f-string, all at `opt.step()`'s line of that program)."""
    monkeypatch.chdir(loop_trace)  # (the trace names `loop.py`, found from the working directory)
    trace = load_trace(loop_trace / "loop.json")
    assert frames_of(trace, "aten::is_nonzero") == {(marked("BOOL LINE"), (), "Frame")}
    assert frames_of(trace, "aten::index") == {(marked("MASK LINE"), (), "Frame")}
    assert frames_of(trace, "<built-in method cpu of Tensor") == {(marked("CPU LINE"), (), "Frame")}
    # aten::item under `if torch.isnan(loss)` (its truth) and under `.item()` in the f-string
    assert frames_of(trace, "aten::item") == {(marked("BOOL LINE"), (), "Frame"), (marked("ITEM LINE"), (), "Frame")}
    # the model's forward is reached through nn.Module.__call__: no line of the module names that
    # callee, so it stays the frame without a line (the recorded line, marked as the profiler's)
    assert frames_of(trace, "aten::addmm") == {(marked("PROFILER LINE"), (), "StartedFrame")}


def test_a_def_line_frame_with_two_lines_that_can_make_the_op_names_both(tmp_path):
    """examples/demo.py loads its batch with `next(batches)` at two lines (the second after
    StopIteration): the H100 plain recording names step()'s def line, and dataloader-bound placed
    the wait there. It names both lines as candidates now, and no line's source as if it were the one."""
    a = audit("analyze", str(FIXTURES / "h100" / "plain" / "plain_demo.json.gz"), "--source-root", str(EXAMPLES),
              out=tmp_path / "out", cwd=EXAMPLES, env={"PYTHONPATH": str(ROOT)})  # (the trace names `demo.py`)
    assert a.returncode == 0, a.stderr[-3000:]
    lines = [i for i, t in enumerate((EXAMPLES / "demo.py").read_text().splitlines(), 1) if "next(batches)" in t]
    assert len(lines) == 2
    [f] = a.rule("dataloader-bound")
    [loc] = f["locations"]
    assert (loc["file"], loc["line"], loc["code"]) == ("demo.py", lines[0], "")
    assert loc["note"] == f"one of lines {lines[0]}, {lines[1]}: the trace records step, not which of its lines"
    # the syncs of that step each have one line that makes them
    assert sorted(loc["line"] for h in a.rule("host-sync") for loc in h["locations"]) == sorted(
        i for i, t in enumerate((EXAMPLES / "demo.py").read_text().splitlines(), 1)
        if "x.to(device)" in t or "loss.item()" in t)


GPU_LOOP = ROOT / "tests" / "data" / "recorded_gpu_module_loop.py"


def test_a_gpu_recording_of_a_module_level_loop_names_the_lines_of_its_syncs_and_device_data(tmp_path):
    """The same loop on a GPU (recorded on an H200, torch 2.11, no auditor in the process), with a
    Dataset that makes CUDA tensors: each sync was placed at `prof.step()`, and the dataset's device
    work at the profiler's line too besides `__getitem__`'s. Each now names the line that made it."""
    source = GPU_LOOP.read_text()
    (tmp_path / GPU_LOOP.name).write_text(source)  # (the trace names it so: found from the working directory)
    a = audit("analyze", str(ROOT / "tests" / "data" / "gpu_module_loop.json.gz"), "--source-root", str(tmp_path),
              out=tmp_path / "out", cwd=tmp_path, env={"PYTHONPATH": str(ROOT)})
    assert a.returncode == 0, a.stderr[-3000:]
    at = {marker: [i for i, t in enumerate(source.splitlines(), 1) if t.endswith(f"# {marker}")]
          for marker in ("BOOL LINE", "MASK LINE", "CPU LINE", "ITEM LINE", "DEVICE LINE")}
    syncs = {_sync_op(f): [loc["line"] for loc in f["locations"]]
             for f in a.rule("host-sync")}
    assert syncs["aten::is_nonzero"] == at["BOOL LINE"]
    assert syncs["aten::index"] == at["MASK LINE"]
    assert syncs["aten::item"] == at["ITEM LINE"]
    assert at["CPU LINE"][0] in syncs["aten::to"]
    assert all(not loc["note"] for f in a.rule("host-sync") for loc in f["locations"])
    [device] = a.rule("dataloader-on-device")
    lines = [loc["line"] for loc in device["locations"]]
    assert lines[:2] == at["DEVICE LINE"]
    next_line = next(i for i, t in enumerate(source.splitlines(), 1) if "next(batches)" in t)
    assert lines[2:] == [next_line]


LAUNCHED = ROOT / "tests" / "data" / "launched_module_loop.py"


def _marked(source: str, marker: str) -> list[int]:
    return [i for i, t in enumerate(source.splitlines(), 1) if t.endswith(f"# {marker}")]


@pytest.fixture(scope="module")
def launched_trace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("launched")
    (root / "prog.py").write_text(LAUNCHED.read_text())
    launcher = ROOT / "tests" / "data" / "plaintrace_launcher.py"
    subprocess.run([sys.executable, str(launcher), "loop.json", "prog.py"], cwd=root, capture_output=True, text=True,
                   timeout=120, check=True)
    return root


def test_a_module_loop_a_launcher_recorded_is_placed_at_its_lines_not_at_opt_step(launched_trace, monkeypatch):
    """Issue #80 item 7. A whole-program recorder runs the program with `runpy.run_path` and steps the
    profiler in an optimizer hook: the module's frame is named by `opt.step()`'s line, below the
    launcher's and runpy's frames. Every op of the loop was placed at `opt.step()`: the frames
    running when the profiler started were read only down to the first library frame (runpy). Now
    each op is at the one line that can make it, never at a line the trace cannot tell."""
    monkeypatch.chdir(launched_trace)
    source = LAUNCHED.read_text()
    trace = load_trace(launched_trace / "loop.json")
    [step] = _marked(source, "STEP LINE")
    assert {f.line for f in map(trace.user_frame, range(len(trace.events))) if f and f.file.endswith("prog.py")
            and type(f).__name__ == "StartedFrame"} == {step}  # (the recorded line, said to be the profiler's)
    assert frames_of(trace, "aten::is_nonzero") == {(*_marked(source, "BOOL LINE"), (), "Frame")}
    assert frames_of(trace, "aten::index") == {(*_marked(source, "MASK LINE"), (), "Frame")}
    assert frames_of(trace, "aten::gt") == {(*_marked(source, "MASK LINE"), (), "Frame")}
    assert frames_of(trace, "<built-in method cpu of Tensor") == {(*_marked(source, "CPU LINE"), (), "Frame")}
    # the forward goes through nn.Module.__call__, which no line names: the frame, said to be the
    # profiler's line, not a precise wrong one
    assert frames_of(trace, "aten::addmm") == {(step, (), "StartedFrame")}


GPU_LAUNCHED = ROOT / "tests" / "data" / "plaintrace_module_loop.py"


def test_a_gpu_recording_of_a_launched_module_loop_names_its_syncs_lines(tmp_path):
    """The same shape on an H100 (derived from the real plain_demo recording: its syncs, copies and
    kernels, the frames of tests/data/plaintrace_module_loop.py). Every finding was at `opt.step()`'s
    line with no note."""
    source = GPU_LAUNCHED.read_text()
    (tmp_path / GPU_LAUNCHED.name).write_text(source)
    a = audit("analyze", str(FIXTURES / "h100" / "derived" / "plaintrace_module_loop.json.gz"), "--source-root",
              str(tmp_path), out=tmp_path / "out", cwd=tmp_path, env={"PYTHONPATH": str(ROOT)})
    assert a.returncode == 0, a.stderr[-3000:]
    [step] = _marked(source, "STEP LINE")
    syncs = {_sync_op(f): [(loc["line"], loc["note"]) for loc in f["locations"]] for f in a.rule("host-sync")}
    assert syncs == {"aten::to": [(*_marked(source, "TO LINE"), "")], "aten::item": [(*_marked(source, "ITEM LINE"), "")]}
    [copies] = a.rule("pageable-copy")
    assert [loc["line"] for loc in copies["locations"]] == _marked(source, "TO LINE")  # (not the model's .to() above)
    [loader] = a.rule("dataloader-bound")
    first, second = _marked(source, "NEXT LINE")
    assert [(loc["line"], loc["code"], loc["note"]) for loc in loader["locations"]] == [
        (first, "", f"one of lines {first}, {second}: the trace records <module>, not which of its lines")]
    assert all(loc["line"] != step or loc["note"] for f in a.findings for loc in f["locations"])


def _sync_op(f: dict) -> str:
    """The operator a host-sync finding names: its evidence's, or its message's ("... aten::to blocked
    the host on the GPU ...")."""
    return f["evidence"].get("op") or re.search(r"(\S+) blocked the host", f["message"])[1]
