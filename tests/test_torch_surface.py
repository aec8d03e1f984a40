"""torch's private surface (auditor/capture/torch_private.py): each private piece the auditor relies on
is where the table says for the installed torch, so a release that moves one fails the test named
after it; the supported range's floor is refused in one line, exit 2, before anything runs."""
from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from auditor.capture import torch_private as tp

VERSION = tp.version()


@pytest.mark.parametrize("piece", tp.PIECES, ids=lambda p: p.path)
def test_each_private_piece_is_where_the_table_says(piece):
    if piece.path == "torch._C:_cuda_attach_out_of_memory_observer" and torch.version.cuda is None:
        pytest.skip("a CPU build of torch has no CUDA bindings")
    found = tp.lookup(piece.path) is not None
    expected = piece.expected(VERSION)
    assert found == expected, (f"{piece.path} (used by {piece.used_by}) is {'present' if found else 'absent'} on "
                               f"torch {torch.__version__}; the table expects it {piece.since}..{piece.until}")
    if not expected:
        assert piece.instead, f"{piece.path}: absent on some supported torch, with nothing said to stand in"


def test_the_memory_history_keywords_the_audit_passes_are_torchs():
    params = inspect.signature(torch.cuda.memory._record_memory_history).parameters
    assert set(tp.RECORD_MEMORY_HISTORY_KEYWORDS) <= set(params), list(params)


def test_the_profilers_cycle_warning_is_found_with_its_spacing():
    """2.10-2.12 join its sentences without spaces, 2.13 on with them; the text the registry is
    given is torch's own literal either way."""
    texts = tp.profiler_warning_texts()
    if VERSION < (2, 10):
        assert texts == []
        return
    assert len(texts) == 1 and texts[0].startswith("Warning: Profiler clears events at the end of each cycle.")
    assert texts[0].endswith("set acc_events=True.")
    assert tp._CYCLE_WARNING.search("Profiler clears events at the end of each cycle.Only events from the current "
                                    "cycle will be reported.To keep events across cycles, set acc_events=True.")


def test_the_mark_dynamo_runs_a_function_for_is_the_one_the_auditor_sets():
    """The auditor marks its own functions as torch._dynamo.assume_constant_result does, without
    importing dynamo: the attribute must be the one that function sets."""
    import torch._dynamo

    marked = torch._dynamo.assume_constant_result(lambda: 1)
    assert getattr(marked, tp.DYNAMO_CONSTANT, None) is True, [a for a in vars(marked) if "dynamo" in a]


def test_whether_compiled_code_moves_the_versions_it_writes_is_read_from_torch():
    """2.4's compiled code writes into its arguments without moving their versions (numerics then
    takes each argument of a compiled call as written); 2.11 on moves them. (Between, whatever the
    wrapper's source says; the numerics test of a NaN written by compiled code checks the outcome.)"""
    moves = tp.compiled_writes_move_versions()
    if VERSION < (2, 5):
        assert moves is False
    elif VERSION >= (2, 11):
        assert moves is True


def test_the_floor_and_what_is_under_it():
    assert tp.unsupported("2.4.0") is None and tp.unsupported("2.14.1+cu130") is None
    assert tp.unsupported("2.3.1+cpu") == ("torch 2.3.1+cpu is older than the oldest the auditor supports (2.4): "
                                           "install torch>=2.4")
    assert tp.unsupported(None) is None  # (no metadata to read: left to the child)
    assert tp.unsupported(str(torch.__version__)) is None


def test_a_missing_rehearsal_piece_is_named(monkeypatch):
    tp.check_rehearsal()  # (every piece is there on a supported torch)
    monkeypatch.setattr(tp, "REHEARSAL_NEEDS", (*tp.REHEARSAL_NEEDS, "torch._C:_no_such_binding"))
    with pytest.raises(tp.Unsupported, match=r"has no torch\._C\._no_such_binding: the CUDA rehearsal"):
        tp.check_rehearsal()


def test_a_torch_older_than_the_floor_is_refused_before_anything_runs(tmp_path):
    """The version comes from the installed package's metadata: a torch 2.3 (here, its metadata
    ahead of the real one on the path) is refused in one line, exit 2, before the target runs."""
    (tmp_path / "torch-2.3.1.dist-info").mkdir()
    (tmp_path / "torch-2.3.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.3.1\n")
    marker = tmp_path / "ran"
    (tmp_path / "prog.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef step():\n    pass\n")
    p = subprocess.run([sys.executable, "-m", "auditor", "run", f"{tmp_path / 'prog.py'}:step", "--steps", "1",
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])})
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr == ("audit: error: torch 2.3.1 is older than the oldest the auditor supports (2.4): "
                        "install torch>=2.4\n")
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_build_without_a_rehearsal_piece_refuses_a_cuda_program_and_runs_a_cpu_one(tmp_path):
    """A torch build that lacks a piece the CUDA rehearsal needs (here, REHEARSAL_NEEDS given one no
    torch has, before the audit starts) refuses a CUDA program on a machine without a GPU in one
    line naming the version and the piece, exit 2, before the program runs; a CPU program, which
    needs no rehearsal, is audited on it as usual."""
    if torch.cuda.is_available():
        pytest.skip("a GPU here: nothing is rehearsed")
    (tmp_path / "sitecustomize.py").write_text(
        "from auditor.capture import torch_private as tp\n"
        "tp.REHEARSAL_NEEDS = (*tp.REHEARSAL_NEEDS, 'torch._C:_no_such_binding')\n")
    marker = tmp_path / "ran"
    programs = {"gpu.py": f"import torch\nopen({str(marker)!r}, 'w').close()\nx = torch.ones(2).cuda()\n"
                          "def step():\n    x.mul_(1.0)\n",
                "cpu.py": "import torch\nx = torch.ones(2)\ndef step():\n    x.mul_(1.0)\n"}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    ends = {}
    for name, source in programs.items():
        (tmp_path / name).write_text(source)
        ends[name] = subprocess.run([sys.executable, "-m", "auditor", "run", f"{tmp_path / name}:step", "--steps", "1",
                                     "--no-profile", "--quiet", "--out", str(tmp_path / f"out-{name}")],
                                    capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    gpu, cpu = ends["gpu.py"], ends["cpu.py"]
    assert gpu.returncode == 2, gpu.stderr[-2000:]
    version = ".".join(map(str, VERSION))
    assert gpu.stderr == (f"audit: error: torch {version} ({tp.installed_version()}) has no torch._C._no_such_binding: "
                          "the CUDA rehearsal (a CUDA program on a machine without a GPU) cannot run on it; run it on "
                          "a GPU, or install another torch build\n"), gpu.stderr
    assert not marker.exists()
    assert cpu.returncode == 0, cpu.stderr[-2000:]
