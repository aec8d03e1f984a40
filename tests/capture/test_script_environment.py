"""What the user's script sees, and what scripts commonly do, under `audit run`: its own command
line in sys.argv (never the auditor's), a working directory changed by the step, a helper process
forked at setup that outlives the run, a progress bar on stderr that never ends its line, and
its warnings, shown as often as in a plain run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from auditor.evidence.model import Evidence
from auditor.evidence.store import save
from conftest import audit

TRAINER = '''
import argparse, os, sys, tempfile, time
import torch

ap = argparse.ArgumentParser()
ap.add_argument("--lr", type=float, required=True)
ap.add_argument("--tag")
args = ap.parse_args()
with open(os.path.join(os.path.dirname(__file__), "argv.json"), "w") as fh:
    import json; json.dump(sys.argv, fh)
with open(os.path.join(os.path.dirname(__file__), "teardown.json"), "w") as fh:
    json.dump(os.environ.get("TEARDOWN_CUPTI"), fh)
if os.fork() == 0:  # a helper (a data server, a metrics daemon): inherits every fd, outlives the run
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # (only the stdout the test reads is let go)
    time.sleep(90)
    os._exit(0)
torch.manual_seed(0)
model = torch.nn.Linear(16, 4)
opt = torch.optim.SGD(model.parameters(), lr=args.lr)

def step(i):
    os.chdir(tempfile.mkdtemp())  # the profiler's trace must still land in --out
    sys.stderr.write("\\r" + "training " * 20000)  # a progress bar redrawn, never a newline
    loss = model(torch.randn(8, 16)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if i == 5:
        raise RuntimeError("stop at " + args.tag)
'''


def test_script_argv_chdir_forked_helper_and_endless_stderr_line(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(TRAINER)
    stale = tmp_path / "out" / "tb" / "train-step" / "host_1.111.pt.trace.json"  # an earlier run's, same DIR
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")
    save(Evidence(source="run", target=f"{path}:step", traces=["tb/train-step/host_1.111.pt.trace.json"]),
         tmp_path / "out")  # (its evidence.json names it: the audit's own, removed once this run's replaces it)
    t0 = time.monotonic()
    a = audit("run", f"{path}:step", "--steps", "8", "--quiet", "--", "--lr", "0.5", "--tag", "six", out=tmp_path / "out")
    took = time.monotonic() - t0
    # argparse saw the script's arguments only, after its own path, as `python train.py ARGS` gives
    assert json.loads((tmp_path / "argv.json").read_text()) == [str(path), "--lr", "0.5", "--tag", "six"]
    # a profiled run's process tears CUPTI down after the window: its later launches pay nothing
    assert json.loads((tmp_path / "teardown.json").read_text()) == "1"
    assert a.returncode == 3, a.stderr[-2000:]
    doc = a.findings_doc
    end = doc["ending"]
    assert end["status"] == "raised" and end["message"] == "stop at six" and end["step"] == 5
    assert doc["steps"]["count"] == 6  # (step 5 is recorded, as failed)
    # the forked helper holds the evidence pipe and stderr for 90 s: the run ends with the child
    assert took < 60, took
    # the profiled window's trace is in the run's directory although each step changed directory
    ev = a.evidence
    assert ev["traces"] and all((a.out / t).is_file() for t in ev["traces"])
    assert not stale.exists() and len(list(stale.parent.iterdir())) == len(ev["traces"])
    assert ev["profile"]["steps"] and not any("missing" in n for n in ev["environment"]["notes"])
    # the 180 kB-a-step stderr line is kept as its end only, then the program's traceback as a plain
    # run prints it: findings.json stays small
    tail = end["stderr_tail"].rstrip()
    assert len(tail) < 50_000 and tail.endswith("RuntimeError: stop at six")
    assert tail.split("Traceback (most recent call last):")[0].rstrip().endswith("training")
    assert (a.out / "findings.json").stat().st_size < 200_000


WARNS = '''
import warnings
import torch

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(8, 4)


def step(i):
    loss = model(x).pow(2).mean()
    warnings.warn("the trainer's own warning")  # shown once, by Python's default filter
    opt.zero_grad()
    loss.backward()
    opt.step()
    logged = float(loss)  # torch warns too (requires_grad), through the auditor's probe
'''


def warning_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "Warning: " in ln]


@pytest.fixture(scope="module")
def warns(tmp_path_factory):
    """WARNS's path, the warning lines of its plain run (8 steps: each warning shown once, at its
    first step, so the lines of a plain run of 3 are these too), and its audit of N steps (each N
    audited once, shared by the tests here)."""
    d = tmp_path_factory.mktemp("warns")
    path = d / "warns.py"
    path.write_text(WARNS)
    plain = subprocess.run([sys.executable, "-c", "import warns\nfor i in range(8): warns.step(i)"],
                           cwd=d, capture_output=True, text=True, check=True,
                           env={"OMP_NUM_THREADS": "1", **os.environ})
    expected = warning_lines(plain.stderr)
    assert [ln.split(": ", 2)[1:] for ln in expected] == [
        ["UserWarning", "the trainer's own warning"],
        ["UserWarning", "Converting a tensor with requires_grad=True to a scalar may lead to unexpected behavior."],
    ], plain.stderr
    done = {}

    def audited(steps: int):
        if steps not in done:
            done[steps] = audit("run", f"{path}:step", "--steps", str(steps), "--quiet", out=d / f"out{steps}")
        return done[steps]

    return path, expected, audited


def test_torch_warnings_from_a_probed_call_name_the_users_line(warns):
    """torch warns once about `float(loss)` on a tensor that requires grad; under audit the warning
    names the script's line (not the probe that wraps `Tensor.__float__`), and the call is still
    counted as a sync there (WARNS's audit of 3 steps)."""
    path, _, audited = warns
    a = audited(3)
    assert a.returncode == 0, a.stderr[-2000:]
    line = WARNS.splitlines().index("    logged = float(loss)  # torch warns too (requires_grad), through the auditor's probe") + 1
    assert f"{path}:{line}: UserWarning: Converting a tensor with requires_grad=True" in a.stderr, a.stderr
    assert a.stderr.count("Converting a tensor with requires_grad=True") == 1 and "probes.py" not in a.stderr
    syncs = [(t["what"], t["where"]["line"], t["count"]) for s in a.evidence["steps"] for t in s["tallies"]
             if t["kind"] == "sync"]
    assert syncs == [("float(Tensor)", line, 1)] * 3, syncs


@pytest.mark.parametrize("steps", [8, 3])
def test_the_users_warnings_are_shown_as_often_as_in_a_plain_run(warns, steps):
    """A warning in the step is shown once, as Python's default filter does in a plain run. It was
    shown again when the profiler window started (the auditor silenced a warning of torch's
    profiler with `catch_warnings`, and any change of the warnings filters makes Python forget
    which warnings it has shown), and after every `float(loss)` (the probe that moves torch's
    warning about it to the user's line caught it the same way): here in every step, 8 times in 8
    (3 in 3). A run of 3 steps has no profiler warm-up step; torch's warning about that is still
    not shown."""
    _, expected, audited = warns
    a = audited(steps)
    assert a.returncode == 0, a.stderr[-2000:]
    assert a.evidence["profile"]["steps"]  # (the profiler window ran)
    assert warning_lines(a.stderr) == expected, a.stderr
    assert "Profiler won't be using warmup" not in a.stderr


def test_thread_count_is_the_one_the_setup_leaves(tmp_path):
    """`torch.set_num_threads(3)` at import: the environment says 3 threads (what the steps ran
    with, and what dataloader-bound weighs workers against), not the count at the auditor's start
    (1 here, from OMP_NUM_THREADS)."""
    path = tmp_path / "threads.py"
    path.write_text("import os, torch\ntorch.set_num_threads(3)\nopen(os.path.join(os.path.dirname(__file__), "
                    "'teardown.txt'), 'w').write(repr(os.environ.get('TEARDOWN_CUPTI')))\n\n"
                    "def step():\n    torch.ones(4).sum()\n")
    a = audit("run", f"{path}:step", "--steps", "2", "--no-profile", "--quiet", out=tmp_path / "out",
              env={"OMP_NUM_THREADS": "1", "TEARDOWN_CUPTI": "0"})
    assert a.returncode == 0, a.stderr[-2000:]
    assert (tmp_path / "teardown.txt").read_text() == "'0'"  # (the user's own value is kept)
    assert a.findings_doc["environment"]["num_threads"] == 3


TTY_PROG = '''
import sys
open("isatty.txt", "w").write(repr([sys.stderr.isatty(), sys.stdout.isatty()]))
sys.stderr.write("one\\ntwo\\n")
'''


def _under_pty(cmd: list[str], cwd, env) -> tuple[int, bytes]:
    """Run `cmd` with stdin, stdout and stderr on one pseudo-terminal (as in a terminal, with its
    post-processing off: the bytes are read as written); its return code and what it showed."""
    import pty
    import termios

    master, slave = pty.openpty()
    attrs = termios.tcgetattr(slave)
    attrs[1] &= ~termios.ONLCR
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    p = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env)
    os.close(slave)
    shown = b""
    while True:
        try:
            b = os.read(master, 1 << 16)
        except OSError:  # (EIO: every holder of the terminal is gone)
            break
        if not b:
            break
        shown += b
    os.close(master)
    return p.wait(timeout=120), shown


@pytest.mark.slow
def test_the_program_sees_a_terminal_where_audit_has_one(tmp_path):
    """Under a terminal the program's stderr is a terminal, as in a plain run (a pipe to `audit`
    before: isatty() False, progress bars printed line after line); its lines are forwarded as
    written ("\\n", not the terminal's "\\r\\n" twice). Under a pipe it stays a pipe."""
    (tmp_path / "prog.py").write_text(TTY_PROG)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "auditor", "run", "prog.py", "-q", "--no-profile", "--out", str(tmp_path / "o")]
    code, shown = _under_pty(cmd, tmp_path, env)
    assert code == 0, shown[-2000:]
    assert (tmp_path / "isatty.txt").read_text() == "[True, True]"
    assert b"one\ntwo\n" in shown, shown[-2000:]
    p = subprocess.run([*cmd[:-1], str(tmp_path / "o2")], cwd=tmp_path, env=env, capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert (tmp_path / "isatty.txt").read_text() == "[False, False]"
    assert b"one\ntwo\n" in p.stderr
