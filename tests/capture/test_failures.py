"""However the target ends (raise, Ctrl-C, OOM, segfault, os._exit, SIGKILL), a report of every step
seen is written, with what ended it, and `audit run` exits 3."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, audit

# A step with a backward pass and no optimizer: these tests are of how a run ends and what its
# report and exit say, and an optimizer's first call imports torch._dynamo (~1.1 s of CPU a run;
# the auditor's profiler start does not). Tests that read the profiled window or the graph scans
# placed around it audit it profiled; the others with --no-profile (UNPROFILED).
TRAINER = '''
import os, signal, ctypes
import torch
torch.manual_seed(0)
w = torch.randn(64, 64, requires_grad=True)
{setup}

def step(i):
    loss = (torch.randn(32, 64) @ w).pow(2).mean()
    loss.backward()
    if i == 3:
        {ending}
'''
UNPROFILED = ("--no-profile",)


def write_trainer(tmp_path: Path, ending: str, setup: str = "") -> Path:
    path = tmp_path / "trainer.py"
    path.write_text(TRAINER.format(ending=ending, setup=setup))
    return path


def line_of(tmp_path: Path, text: str) -> int:
    lines = (tmp_path / "trainer.py").read_text().splitlines()
    return next(i for i, ln in enumerate(lines, 1) if text in ln)


def assert_users_traceback(stderr: str, tmp_path, line_text: str, last: str):
    """The traceback a plain run prints, on stderr before the summary: the step's frame at its line,
    the exception last, none of the auditor's frames (its step loop, its signal handler)."""
    tb = stderr[stderr.index("Traceback (most recent call last):"):]
    frame = f'  File "{tmp_path / "trainer.py"}", line {line_of(tmp_path, line_text)}, in step\n'
    assert frame in tb and tb.splitlines()[tb.splitlines().index(frame.rstrip("\n")) + 2] == last, stderr
    assert "auditor" not in tb.split(last)[0], tb


def run_ending(tmp_path, ending, setup="", profiled=True):
    """Audit TRAINER ending in step 3 with `ending`: profiled, or (profiled=False) unprofiled where
    the test reads only the ending, the steps and the exit."""
    path = write_trainer(tmp_path, ending, setup)
    a = audit("run", f"{path}:step", "--steps", "8", "--quiet", *(() if profiled else UNPROFILED),
              out=tmp_path / "out")
    assert a.returncode == 3, a.stderr
    assert "Traceback" not in a.stdout
    doc = a.findings_doc
    return a, doc


def test_step_that_raises(tmp_path):
    a, doc = run_ending(tmp_path, 'raise ValueError("bad batch")')
    end = doc["ending"]
    assert end["status"] == "raised" and end["exception"] == "ValueError" and end["message"] == "bad batch"
    assert end["step"] == 3
    assert end["where"]["file"].endswith("trainer.py") and end["where"]["line"] == line_of(tmp_path, "bad batch")
    assert_users_traceback(a.stderr, tmp_path, "bad batch", "ValueError: bad batch")
    assert doc["steps"]["count"] == 4  # steps 0-2 complete, step 3 partial
    assert (tmp_path / "out" / "report.html").is_file()
    # the step that raised is scanned too: graph-leak compares it with step 0 (and finds no leak);
    # (the scan after step 1 runs after step 0: the profiled window is steps 1-3)
    assert [(g["after_step"], g["failed"]) for g in a.evidence["graph_scans"]] == [(0, False), (3, True)]
    assert not [s for s in doc["skipped_rules"] if s["rule"] == "graph-leak"] and not a.rule("graph-leak")


@pytest.mark.parametrize("str_body", ['raise RuntimeError("no text")', "return 5"])
def test_an_exception_whose_str_fails_is_still_named_at_its_line(tmp_path, str_body):
    """An exception whose `__str__` raises or returns a non-string: the run ends `raised` in the
    step that raised it, with its type, its line and Python's `<exception str() failed>` (it ended
    "crashed during step 4" with no type and no line)."""
    setup = f"class E(Exception):\n    def __str__(self):\n        {str_body}\n"
    a, doc = run_ending(tmp_path, 'raise E("x")', setup=setup, profiled=False)
    end = doc["ending"]
    assert (end["status"], end["step"], end["exception"]) == ("raised", 3, "E")
    assert end["message"] == "<exception str() failed>"
    assert end["where"]["line"] == line_of(tmp_path, 'raise E("x")')


@pytest.mark.parametrize("code,status,exit_code", [("0", "exited", 0), ("", "exited", 0), ("2", "raised", 3)])
def test_sys_exit_in_a_step(tmp_path, code, status, exit_code):
    """A program that stops itself on purpose (`sys.exit(0)` on convergence) has not failed: the
    run ends `exited` at that step, the steps before it are reported, and `audit run` exits 0.
    A non-zero exit code is a failure (exit 3)."""
    path = write_trainer(tmp_path, f"raise SystemExit({code})")
    a = audit("run", f"{path}:step", "--steps", "8", "--quiet", *UNPROFILED, out=tmp_path / "out")
    assert a.returncode == exit_code, a.stderr
    end = a.findings_doc["ending"]
    assert (end["status"], end["step"], end["exception"]) == (status, 3, "SystemExit")
    assert a.findings_doc["steps"]["count"] == 4
    if status == "exited":
        assert "stopped itself" in end["message"]
        assert "The run ended: <strong>exited</strong> in step 3" in (a.out / "report.html").read_text()


def test_sys_exit_0_in_the_setup_exits_0_and_a_message_is_printed(tmp_path):
    """`sys.exit(0)` in the module's setup: the program stopped itself with success, as a plain run
    exits 0 (it was exit 3). `sys.exit("message")`, in the setup or a step, prints the message on
    stderr as Python does (it was not shown), and fails the run (exit 3)."""
    path = write_trainer(tmp_path, "pass", setup="import sys; sys.exit(0)")
    a = audit("run", f"{path}:step", "--steps", "8", "--quiet", *UNPROFILED, out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    assert (a.findings_doc["ending"]["status"], a.findings_doc["ending"]["step"]) == ("exited", None)
    for setup, ending in (("import sys; sys.exit('no data here')", "pass"), ("", "sys.exit('no data here')")):
        path = write_trainer(tmp_path, ending, setup=setup + "\nimport sys")
        a = audit("run", f"{path}:step", "--steps", "8", "--quiet", *UNPROFILED, out=tmp_path / "out-msg")
        assert a.returncode == 3 and a.stderr.count("no data here\n") == 1, a.stderr


def test_the_program_sees_the_environment_it_was_given(tmp_path):
    """The variables the auditor sets for torch's logging are not in the program's os.environ
    (nor in what it starts); one the user set stays."""
    path = write_trainer(tmp_path, "pass", setup="import sys; print(sorted(k for k in os.environ if k in "
                         "('KINETO_LOG_LEVEL', 'TORCH_CPP_LOG_LEVEL', 'PYTHONFAULTHANDLER', 'MY_VAR')), "
                         "file=sys.stderr)")
    # (the parent sets them for the child whether or not it profiles: runner.run_child)
    a = audit("run", f"{path}:step", "--steps", "2", "--quiet", *UNPROFILED, out=tmp_path / "out")
    assert a.returncode == 0 and "[]\n" in a.stderr, a.stderr
    a = audit("run", f"{path}:step", "--steps", "2", "--quiet", *UNPROFILED, out=tmp_path / "out2",
              env={**os.environ, "TORCH_CPP_LOG_LEVEL": "WARNING", "MY_VAR": "1"})
    assert a.returncode == 0 and "['MY_VAR', 'TORCH_CPP_LOG_LEVEL']\n" in a.stderr, a.stderr


def test_os_exit_0_in_a_step_is_a_stop_not_a_crash(tmp_path):
    """`os._exit(0)` in a step: the program ended its process with success, as sys.exit(0) but
    without the clean-up; `exited` at that step, exit 0 (it was reported as a crash, exit 3). The
    same call in the setup, before any step, still fails the run."""
    path = write_trainer(tmp_path, "os._exit(0)")
    a = audit("run", f"{path}:step", "--steps", "8", "--quiet", *UNPROFILED, out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    end = a.findings_doc["ending"]
    assert (end["status"], end["step"], end["returncode"]) == ("exited", 3, 0) and "os._exit(0)" in end["message"]
    assert a.findings_doc["steps"]["count"] == 3
    path = write_trainer(tmp_path, "pass", setup="os._exit(0)")
    a = audit("run", f"{path}:step", "--steps", "8", "--quiet", *UNPROFILED, out=tmp_path / "out-setup")
    assert a.returncode == 3 and a.findings_doc["ending"]["status"] == "crashed"


def test_keyboard_interrupt(tmp_path):
    a, doc = run_ending(tmp_path, "os.kill(os.getpid(), signal.SIGINT)", profiled=False)
    assert doc["ending"]["status"] == "interrupted" and doc["ending"]["step"] == 3
    assert doc["ending"]["message"] == "stopped by SIGINT"
    assert_users_traceback(a.stderr, tmp_path, "signal.SIGINT", "KeyboardInterrupt")


def test_out_of_memory(tmp_path):
    a, doc = run_ending(tmp_path, "torch.empty(2**50)", profiled=False)  # a real failed allocation: 4 PiB
    assert doc["ending"]["status"] == "oom" and doc["ending"]["step"] == 3
    assert "allocate" in doc["ending"]["message"]


@pytest.mark.parametrize("ending,status,signal_name,code", [
    ("ctypes.string_at(0)", "crashed", "SIGSEGV", -11),
    ("os._exit(7)", "crashed", None, 7),
    ("os.kill(os.getpid(), signal.SIGKILL)", "crashed", "SIGKILL", -9),
])
def test_hard_crash_still_reports(tmp_path, ending, status, signal_name, code):
    a, doc = run_ending(tmp_path, ending)
    end = doc["ending"]
    assert end["status"] == status and end["signal"] == signal_name and end["returncode"] == code
    assert end["step"] == 3
    assert doc["steps"]["count"] == 3  # every step completed before the crash
    if signal_name == "SIGSEGV":
        assert "Segmentation fault" in end["stderr_tail"]  # faulthandler's dump, kept for the report
        # ...and its most recent frame of the user's names the line (it had no location)
        assert end["where"]["file"].endswith("trainer.py") and end["where"]["line"] == line_of(tmp_path, ending)
    # graph-leak had one scan (after step 0, before the window of steps 1-3): why it is skipped
    # says the run ended early
    [why] = [s["reason"] for s in doc["skipped_rules"] if s["rule"] == "graph-leak"]
    assert "the run ended in step 2 of 8, before its second scan (scanned after step: 0)" in why


def test_setup_code_that_raises(tmp_path):
    path = write_trainer(tmp_path, "pass", setup='raise RuntimeError("no data at /data/train")')
    a = audit("run", f"{path}:step", "--steps", "4", "--quiet", *UNPROFILED, out=tmp_path / "out")
    assert a.returncode == 3
    doc = a.findings_doc
    assert doc["ending"]["status"] == "raised" and doc["ending"]["step"] is None
    assert doc["ending"]["where"]["line"] == line_of(tmp_path, "no data at") and doc["steps"]["count"] == 0


REFUSING_MODE = '''
import torch
from torch.overrides import TorchFunctionMode

torch.set_default_device("cpu")


class Strict(TorchFunctionMode):  # a tracer that refuses the ops it does not know: here, all of them
    def __torch_function__(self, func, types, args=(), kwargs=None):
        raise RuntimeError(f"Strict: {func.__name__} is not supported")


Strict().__enter__()
x = torch.ones(3)  # REFUSED


def step():
    pass
'''


def test_a_mode_entered_at_import_that_refuses_a_call_ends_the_setup_in_one_line(tmp_path):
    """The user's mode, entered at import, refuses a call in the setup: the run ends there, raised,
    with the mode's own error, as any setup failure does. It stayed on the stack, and the auditor's
    read of the backend settings (`torch.get_default_device()`, which makes a tensor to learn the
    device) went through it: refused again, that ended the run as 'crashed', in a traceback of the
    auditor's dumped to the user's terminal. The auditor's reads run with torch-function dispatch
    off now."""
    path = tmp_path / "strict.py"
    path.write_text(REFUSING_MODE)
    a = audit("run", f"{path}:step", "--steps", "2", out=tmp_path / "out")
    assert a.returncode == 3, a.stderr[-2000:]
    assert "Traceback" not in a.stderr and "Traceback" not in a.stdout, a.stderr[-2000:]
    assert "run ended: raised: RuntimeError: Strict: ones is not supported" in a.stdout + a.stderr
    end = a.findings_doc["ending"]
    assert (end["status"], end["step"], end["exception"]) == ("raised", None, "RuntimeError")
    assert end["where"]["file"] == str(path)
    assert "REFUSED" in end["traceback"]  # (the setup's line, in the report's traceback)
    assert a.findings_doc["environment"]["backend_flags"]["default_device"] == "cpu"


def test_a_syntax_error_names_its_line(tmp_path):
    """A trainer that does not parse: the ending names the bad line of the user's file (it is in no
    frame of the traceback, which ends in the auditor's import of the target)."""
    path = tmp_path / "broken.py"
    path.write_text("import torch\n\n\ndef step():\n    x = (1,\n")
    a = audit("run", f"{path}:step", "--steps", "2", "--quiet", out=tmp_path / "out")
    assert a.returncode == 3
    end = a.findings_doc["ending"]
    assert end["exception"] == "SyntaxError" and end["where"]["file"] == str(path) and end["where"]["line"] == 5


def test_ctrl_c_on_the_process_group(tmp_path):
    """A real Ctrl-C: SIGINT to the whole process group while steps run."""
    p, out, _ = _start_slow_audit(tmp_path)
    os.killpg(p.pid, signal.SIGINT)
    p.communicate(timeout=60)
    assert p.returncode == 3
    doc = json.loads((out / "findings.json").read_text())
    assert doc["ending"]["status"] == "interrupted"
    assert doc["ending"]["message"] == "stopped by SIGINT"  # (the signal by its name, never SIGTERM's)
    assert 3 <= doc["steps"]["count"] < 200


def test_a_sigint_then_a_sigterm_to_the_audit_alone_is_labelled_by_both_in_order(tmp_path):
    """A harness's SIGINT to `audit` alone, then its SIGTERM: the ending names the SIGINT first
    (it was labelled "(SIGTERM)", the last signal overwriting the first) and the audit's kill."""
    p, out, _ = _start_slow_audit(tmp_path)
    os.kill(p.pid, signal.SIGINT)
    time.sleep(0.5)
    os.kill(p.pid, signal.SIGTERM)
    p.communicate(timeout=60)
    assert p.returncode == 3
    end = json.loads((out / "findings.json").read_text())["ending"]
    assert end["status"] == "interrupted" and end["signal"] == "SIGINT"
    assert end["message"] == "interrupted (SIGINT, then SIGTERM; the audit killed the program (SIGKILL))"


def test_an_interrupt_swallowed_on_the_way_still_ends_the_run(tmp_path):
    """A Ctrl-C that lands in code that swallows the KeyboardInterrupt (a library catching it)
    still ends the run at that step, as interrupted."""
    swallow = "try:\n            signal.raise_signal(signal.SIGINT)\n        except KeyboardInterrupt:\n            pass"
    a, doc = run_ending(tmp_path, swallow, profiled=False)
    assert doc["ending"]["status"] == "interrupted" and doc["ending"]["step"] == 3
    assert doc["steps"]["count"] == 4  # step 3 itself completed and was recorded


SLOW_STEP = "import time\n\ndef step(i):\n    time.sleep(0.2)\n"


def _start_slow_audit(tmp_path, steps_before: int = 3, source: str = SLOW_STEP):
    """`audit run` of a slow step (`source`'s `step`), in its own session; returns once `steps_before`
    steps are recorded."""
    path = tmp_path / "slow.py"
    path.write_text(source)
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-m", "auditor", "run", f"{path}:step", "--steps", "200", "--quiet",
                          "--no-profile", "--out", str(out)], cwd=ROOT, start_new_session=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    records = out / "records.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if records.exists() and records.read_text().count('"kind":"step"') >= steps_before:
            break
        time.sleep(0.1)
    child = json.loads(records.read_text().splitlines()[0])["pid"]  # (the "hello" record)
    return p, out, child


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("group", [False, True])
def test_sigterm_stops_the_run_with_a_report(tmp_path, group):
    """A job scheduler's or `kill`'s SIGTERM, to `audit` alone or to its whole process group, ends
    the run as Ctrl-C does: the child stops at once, the report holds every step seen, exit 3."""
    p, out, child = _start_slow_audit(tmp_path)
    (os.killpg if group else os.kill)(p.pid, signal.SIGTERM)
    p.communicate(timeout=60)
    assert p.returncode == 3
    doc = json.loads((out / "findings.json").read_text())
    end = doc["ending"]
    assert end["status"] == "interrupted" and end["exception"] == "Terminated"
    assert end["where"] is not None, end["traceback"]
    assert end["message"] == "stopped by SIGTERM" and end["where"]["file"].endswith("slow.py")
    assert 3 <= doc["steps"]["count"] < 200
    assert _gone(child, within=1)


def test_a_killed_audit_takes_its_child_with_it(tmp_path):
    """`audit` killed outright (SIGKILL: no report is possible) must not leave the user's training
    running on, orphaned and unseen."""
    p, out, child = _start_slow_audit(tmp_path, steps_before=1)
    p.kill()
    p.communicate(timeout=60)
    assert _gone(child), "the child outlived its parent"


LEAK_TO_OOM = '''
import torch
torch.manual_seed(0)
w = torch.randn(64, 64, requires_grad=True)
opt = torch.optim.SGD([w], lr=0.01)
history = []


def step(i):
    opt.zero_grad()
    loss = (torch.randn(32, 64) @ w).pow(2).mean()
    loss.backward()
    opt.step()
    history.append(loss * 1.0)  # LEAK LINE: each step's graph kept
    if i == 6:
        torch.empty(2**50)  # the allocation a leak ends in
'''


def test_a_leak_that_ends_in_oom_early_is_still_found(tmp_path):
    """"OOM after several episodes, all progress lost": the run dies in step 6 of 50, long before
    the middle and last steps' graph scans. It is scanned after steps 1 and 4 (powers of 4) and
    after the step that raised, and graph-leak names the holder at its line; before, it had the
    step-1 scan only, and graph-leak was skipped."""
    path = tmp_path / "trainer.py"
    path.write_text(LEAK_TO_OOM)
    a = audit("run", f"{path}:step", "--steps", "50", "--quiet", "--no-profile", out=tmp_path / "out")
    assert a.returncode == 3, a.stderr
    assert a.findings_doc["ending"]["status"] == "oom" and a.findings_doc["ending"]["step"] == 6
    scans = a.evidence["graph_scans"]
    assert [(s["after_step"], s["failed"]) for s in scans] == [(1, False), (4, False), (6, True)]
    [leak] = a.rule("graph-leak")
    assert [h["name"] for h in leak["evidence"]["holders"]] == ["history"]
    line = next(n for n, text in enumerate(LEAK_TO_OOM.splitlines(), 1) if "LEAK LINE" in text)
    assert [(loc["file"], loc["line"]) for loc in leak["locations"]] == [(str(path), line)]
    assert leak["evidence"]["compared_steps"][0] == 1 and leak["evidence"]["compared_steps"][-1] == 6


DRY = '''
import torch
from torch.utils.data import DataLoader, TensorDataset
loader = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4)
it = iter(loader)
w = torch.randn(4, 1, requires_grad=True)

def step():
    (x,) = next(it)
    loss = (x @ w).sum()
    loss.item()
    loss.backward()
'''


def test_a_step_whose_data_runs_out_ends_the_run_there(tmp_path):
    """`--steps 20` over 16 batches: step 16's `next(it)` raises StopIteration. The run ends
    `exited` (exit 0) saying the data ran out after 16 steps, and per-step counts are of the 16
    steps that ran (it ended `raised StopIteration`, exit 3, with 17/16-th counts: 0.94 syncs/step)."""
    (tmp_path / "dry.py").write_text(DRY)
    a = audit("run", f"{tmp_path / 'dry.py'}:step", "--steps", "20", *UNPROFILED, out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    end = a.findings_doc["ending"]
    assert (end["status"], end["step"], end["exception"]) == ("exited", 16, "StopIteration")
    assert "the data ran out after 16 step(s)" in end["message"] and "data ran out after 16" in a.stdout
    assert a.findings_doc["steps"]["count"] == 16
    [sync] = a.rule("host-sync")
    assert "1 tensor values read on the host per step" in sync["message"], sync["message"]


def test_a_programs_ctrl_c_prints_its_traceback_as_a_plain_run_does(tmp_path):
    """`audit run train.py` ended by a Ctrl-C: Python's traceback of the program's line, then the
    summary (it printed none: an error printed its traceback, an interrupt nothing)."""
    path = tmp_path / "trainer.py"
    path.write_text("import os, signal\nimport torch\nw = torch.zeros(4, requires_grad=True)\n"
                    "opt = torch.optim.SGD([w], lr=0.1)\nfor i in range(10):\n    (w * 2).sum().backward()\n"
                    "    opt.step()\n    opt.zero_grad()\n    if i == 3:\n        os.kill(os.getpid(), signal.SIGINT)\n")
    a = audit("run", str(path), "--steps", "8", "--quiet", "--no-profile", out=tmp_path / "out")
    assert a.returncode == 3, a.stderr
    tb = a.stderr[a.stderr.index("Traceback (most recent call last):"):]
    assert tb.splitlines()[1:4] == [f'  File "{path}", line 10, in <module>',
                                    "    os.kill(os.getpid(), signal.SIGINT)", "KeyboardInterrupt"], tb
    assert a.findings_doc["ending"]["status"] == "interrupted"


def test_a_program_that_raises_as_sigterm_stops_it_was_stopped_not_failed(tmp_path):
    """The program raises as the audit's SIGTERM stops it (a DataLoader whose workers the same group
    SIGTERM killed: "DataLoader worker ... killed by signal: Terminated"; here a handler of its own):
    the ending says the run was stopped by the signal sent to the audit, and what the program raised,
    not that the program failed by itself."""
    p, out, _ = _start_slow_audit(tmp_path, source=(
        "import signal\nimport time\n\n\ndef on_term(signum, frame):\n"
        "    raise RuntimeError('DataLoader worker (pid 4242) is killed by signal: Terminated. ')\n\n\n"
        "signal.signal(signal.SIGTERM, on_term)\n\n\ndef step(i):\n    time.sleep(0.2)\n"))
    os.kill(p.pid, signal.SIGTERM)
    p.communicate(timeout=60)
    assert p.returncode == 3
    end = json.loads((out / "findings.json").read_text())["ending"]
    assert end["status"] == "interrupted" and end["signal"] == "SIGTERM" and end["exception"] == "RuntimeError"
    assert end["message"] == ("stopped by SIGTERM sent to the audit; as it stopped, the program raised "
                              "RuntimeError: DataLoader worker (pid 4242) is killed by signal: Terminated."), end
    assert end["where"]["file"].endswith("slow.py") and end["where"]["line"] == 6
