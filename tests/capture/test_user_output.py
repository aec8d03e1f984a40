"""What the audited program prints is the program's: a warning torch raises inside a call the
audit passes on names the user's line, and the profiler's stage markers never reach the terminal,
also where one lands on a line the program left open (a progress bar's redraw)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from auditor.capture import torch_private
from auditor.capture.runner import PROFILER_NOISE

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = """\
import sys
import torch
model = torch.nn.Linear(3, 1).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.ones(4, 3, device="cuda")
for i in range(6):
    y = torch.tensor(x)  # torch warns: copy-construct from a tensor
    loss = model(y).sum()
    opt.zero_grad(); loss.backward(); opt.step()
    sys.stderr.write(f"\\rstep {i}")
    sys.stderr.flush()
sys.stderr.write("\\n")
print("done")
import warnings; warnings.warn("the program's own warning")
"""


@pytest.mark.slow
def test_a_rehearsed_programs_warning_names_its_line_and_no_profiler_marker_shows(tmp_path):
    """Rehearsed, torch's copy-construct warning was shown at auditor/capture/rehearsal/device.py
    (the mode's call of the op), and Kineto's "STAGE:... Completed Stage: Warm Up" was printed on
    the progress line the program had left open."""
    script = tmp_path / "warn_prog.py"
    script.write_text(PROGRAM)
    p = subprocess.run([sys.executable, "-m", "auditor", "run", str(script), "--steps", "6", "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"{script}:7: UserWarning: To copy construct from a tensor" in p.stderr, p.stderr
    assert "auditor/" not in p.stderr.replace(str(tmp_path), "")
    assert "STAGE:" not in p.stderr and "Completed Stage" not in p.stderr
    assert "Profiler clears events" not in p.stderr
    assert f"{script}:14: UserWarning: the program's own warning" in p.stderr, p.stderr
    assert "step 5" in p.stderr and "done" in p.stdout


def test_a_marker_inside_a_programs_line_is_cut_and_the_line_kept():
    marker = b"STAGE:2026-11-25 01:04:38 8715:8715 SyncActivityProfilerHandler.cpp:51] Completed Stage: Warm Up\n"
    assert PROFILER_NOISE.sub(b"", b" 40%|####      | 4/10" + marker) == b" 40%|####      | 4/10"
    assert PROFILER_NOISE.sub(b"", marker) == b""
    assert PROFILER_NOISE.sub(b"", b"loss 0.5 at Foo.cpp:12] kept\n") == b"loss 0.5 at Foo.cpp:12] kept\n"
    # (a CUDA build of torch on a machine without a GPU, at the profiler's start)
    no_gpu = b"ERROR:2026-11-26 04:50:40 25518:25518 DeviceProperties.cpp:46] gpuGetDeviceCount failed with code 35\n"
    assert PROFILER_NOISE.sub(b"", b"step 1\n" + no_gpu) == b"step 1\n"


PREPARE_TWICE = """
import warnings, torch
from torch.profiler import profile, ProfilerActivity
from auditor.capture.child import _no_cycle_warning
{call}
p = profile(activities=[ProfilerActivity.CPU])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    p.prepare_trace()
    try:  # (2.10-2.12 warn at every prepare, and refuse a second before the first trace starts)
        p.prepare_trace()
    except RuntimeError:
        pass
print(sum("clears events" in str(w.message) for w in caught))
"""


@pytest.mark.parametrize("call, shown", [("_no_cycle_warning()", "0"), ("", "1")])
def test_the_profilers_cycle_warning_is_marked_shown(call, shown):
    """A profile that prepares a second cycle warns "Profiler clears events at the end of each
    cycle" (on the H100 runs, on the user's stderr); the window marks it shown in torch's registry."""
    if not torch_private.profiler_warning_texts():
        pytest.skip("this torch has no such warning (it came with 2.10)")
    p = subprocess.run([sys.executable, "-c", PREPARE_TWICE.format(call=call)], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split()[-1] == shown


WARNING_PROGRAM = """\
import logging
import sys
import warnings
import auditor.capture.unseen as unseen
unseen.warnings_name_the_user()
{setup}


def through_the_auditor():  # (a warning whose innermost Python frame is one of the auditor's lines)
    warnings.warn_explicit("raised inside a wrapped call", UserWarning, unseen.__file__, 5)


through_the_auditor()
warnings.warn("the program's own warning")
"""


@pytest.mark.parametrize("setup", ["", "logging.captureWarnings(True); logging.basicConfig(stream=sys.stderr)"])
def test_warnings_name_the_users_line_also_when_logging_shows_them(tmp_path, setup):
    """A program (or its framework) that routes warnings to logging (logging.captureWarnings)
    replaces warnings.showwarning after the audit started: the auditor's line came back in the
    program's output. The program's own warning is shown as it is."""
    script = tmp_path / "warns.py"
    script.write_text(WARNING_PROGRAM.format(setup=setup))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"{script}:10: UserWarning: raised inside a wrapped call" in p.stderr, p.stderr
    assert f"{script}:14: UserWarning: the program's own warning" in p.stderr, p.stderr
    assert "auditor" not in p.stderr.replace(str(tmp_path), ""), p.stderr


BAR = """\
import sys
import torch
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(50):
    loss = model(torch.ones(4, 3)).sum()
    opt.zero_grad(); loss.backward(); opt.step()
    sys.stderr.write(f"\\rstep {i}")  # a progress bar's redraw, as tqdm's on stderr
    sys.stderr.flush()
"""


def test_the_audits_lines_do_not_continue_a_progress_bars_line(tmp_path):
    """The audit ends the program after its steps, on a line its progress bar left open (a redraw
    ends in no newline): the audit's own lines were printed on the end of that line on a terminal
    ("step 9audit of prog.py: ..."). The line is ended first; a line the program ended gets no
    blank line after it."""
    script = tmp_path / "prog.py"
    for text, ends in ((BAR, b"step 8\rstep 9\n"), (BAR.replace('f"\\rstep {i}"', 'f"step {i}\\n"'), b"step 8\nstep 9\n")):
        script.write_text(text)
        p = subprocess.run([sys.executable, "-m", "auditor", "run", str(script), "--steps", "10", "--no-profile",
                            "--out", str(tmp_path / "out")], capture_output=True, cwd=tmp_path, timeout=300,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})  # (bytes: a "\r" is kept as written)
        assert p.returncode == 0, p.stderr[-3000:]
        assert p.stderr.endswith(ends), p.stderr[-40:]
