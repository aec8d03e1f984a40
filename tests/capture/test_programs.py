"""`audit run file.py` and `audit run -m pkg.mod`: whole programs, run as Python runs them.

A table of programs shaped like public training scripts; each row asserts the steps found, the
findings at their lines, and the files the program writes at its end."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field

import pytest

from conftest import EXAMPLES, audit, expected_lines

# (each program writes "finally.txt" in a finally block and "atexit.txt" from an atexit handler,
# both in the current directory, when its END is reached)
END = """
import atexit as _atexit
_atexit.register(lambda: open("atexit.txt", "w").write("atexit"))
"""

EPOCHS_EVAL = END + '''
import argparse, time
import torch
from torch.utils.data import DataLoader, Dataset

class Slow(Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        time.sleep(0.001)
        return torch.randn(8), torch.randn(1)

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=1)
    args = ap.parse_args()
    train = DataLoader(Slow(), batch_size=4)  # LINE:loader
    val = DataLoader(Slow(), batch_size=16)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.Adam(model.parameters())
    log = []
    try:
        for epoch in range(args.epochs):
            for x, y in train:
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                log.append(loss.item())  # LINE:item
            with torch.no_grad():
                for x, y in val:
                    model(x).sum().item()  # LINE:eval-item
    finally:
        open("finally.txt", "w").write(str(len(log)))

if __name__ == "__main__":
    main()
'''

WHILE_ACCUMULATE = END + '''
import torch
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
it = 0
try:
    while True:
        loss = model(torch.randn(4, 8)).pow(2).mean() / 4
        loss.backward()
        it += 1
        if it % 4 == 0:
            opt.step()
            opt.zero_grad()
        if it >= 200:
            break
finally:
    open("finally.txt", "w").write(str(it))
'''

GAN = END + '''
import torch
from torch.utils.data import DataLoader, TensorDataset
G, D = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)
opt_g, opt_d = torch.optim.Adam(G.parameters()), torch.optim.SGD(D.parameters(), lr=0.01)
loader = DataLoader(TensorDataset(torch.randn(128, 8)), batch_size=8)
try:
    for epoch in range(2):
        for (real,) in loader:
            fake = G(torch.randn(8, 4))
            loss_d = D(real).mean() - D(fake.detach()).mean()
            opt_d.zero_grad()
            loss_d.backward()
            opt_d.step()
            loss_g = -D(fake).mean()
            opt_g.zero_grad()
            loss_g.backward()
            opt_g.step()
finally:
    open("finally.txt", "w").write("gan")
'''

EXITS_3 = END + '''
import sys
import torch
m = torch.nn.Linear(2, 2)
o = torch.optim.SGD(m.parameters(), lr=0.1)
try:
    for i in range(4):
        m(torch.randn(1, 2)).sum().backward()
        o.step()
finally:
    open("finally.txt", "w").write("3")
sys.exit(3)
'''

MARKER = END + '''
import torch
import auditor
w = torch.randn(32, 32)
try:
    for i in range(40):
        y = (w @ w).sum()
        y.item()  # LINE:float
        auditor.step()
finally:
    open("finally.txt", "w").write("marker")
'''

GRAD_SCALER = END + '''
import torch
m = torch.nn.Linear(4, 1)
o = torch.optim.SGD(m.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", init_scale=3e38)  # inf gradients at first: their steps are skipped
try:
    for i in range(20):
        scaler.scale(m(torch.randn(2, 4)).sum()).backward()
        scaler.step(o)
        scaler.update()
        o.zero_grad()
finally:
    open("finally.txt", "w").write("scaler")
'''


COMPILED_STEP = END + '''
import torch
m = torch.nn.Linear(8, 1)
o = torch.optim.SGD(m.parameters(), lr=0.01)


@torch.compile  # the optimizer step runs as compiled code: no Python hook of its runs
def update():
    o.step()


try:
    for i in range(12):
        m(torch.randn(16, 8)).pow(2).mean().backward()
        update()
        o.zero_grad()
finally:
    open("finally.txt", "w").write("compiled")
'''

GAN_NO_LOADER = END + '''
import torch
G, D = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)
opt_g, opt_d = torch.optim.Adam(G.parameters()), torch.optim.SGD(D.parameters(), lr=0.01)
try:
    for it in range(20):
        real = torch.randn(8, 8)
        fake = G(torch.randn(8, 4))
        loss_d = D(real).mean() - D(fake.detach()).mean()
        opt_d.zero_grad()
        loss_d.backward()
        opt_d.step()
        loss_g = -D(fake).mean()
        opt_g.zero_grad()
        loss_g.backward()
        opt_g.step()
finally:
    open("finally.txt", "w").write("gan")
'''


CUSTOM_UPDATE = END + '''
import torch
from torch.utils.data import DataLoader, TensorDataset
loader = DataLoader(TensorDataset(torch.randn(256, 8), torch.randn(256, 1)), batch_size=8)
w = torch.zeros(8, 1, requires_grad=True)
lr = 0.01
try:
    for epoch in range(2):
        for x, y in loader:  # no torch.optim: the weights are updated by hand
            loss = ((x @ w - y) ** 2).mean()
            loss.backward()
            with torch.no_grad():
                w -= lr * w.grad
                w.grad.zero_()
finally:
    open("finally.txt", "w").write("custom")
'''


@dataclass
class Program:
    source: str
    args: tuple[str, ...]  # audit's options, then `--` and the program's own
    steps: int  # steps recorded
    steps_by: str
    findings: dict[str, str] = field(default_factory=dict)  # rule -> LINE tag of the line it names
    files: tuple[str, ...] = ("finally.txt", "atexit.txt")
    exit_code: int = 0
    ended_by_audit: bool = True
    numerics: bool = False  # audited with the numerics collector (the default audit)
    slow: bool = False  # marked slow (torch.compile compiles for a minute on a busy machine)


# pytorch/examples' word_language_model as it runs by default: an LSTM language model over a token
# tensor sliced into batches (no DataLoader), its weights updated by hand through `.data` (its
# torch.optim.SGD only behind --use-optimizer, so the program names an optimizer it never makes)
MANUAL_UPDATE = END + '''
import argparse
import torch
from torch import nn
ap = argparse.ArgumentParser()
ap.add_argument("--use-optimizer", action="store_true")
ap.add_argument("--accumulate", type=int, default=1)
ap.add_argument("--no-grad-update", action="store_true")
args = ap.parse_args()
torch.manual_seed(0)
V, T, B = 50, 12, 4
data = torch.randint(0, V, (T * 400, B))

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.rnn, self.out = nn.Embedding(V, 16), nn.LSTM(16, 16), nn.Linear(16, V)
    def forward(self, x, h):
        y, h = self.rnn(self.emb(x), h)
        return self.out(y), h

model = LM()
if args.use_optimizer:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
lr, done = 0.5, 0
h = None
try:
    for i in range(0, data.size(0) - T - 1, T):
        x, y = data[i:i + T], data[i + 1:i + 1 + T]
        h = None if h is None else tuple(t.detach() for t in h)
        out, h = model(x, h)
        loss = nn.functional.cross_entropy(out.view(-1, V), y.reshape(-1)) / args.accumulate
        loss.backward()
        if (i // T + 1) % args.accumulate:
            continue
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        if args.no_grad_update:
            with torch.no_grad():
                for p in model.parameters():
                    p -= lr * p.grad
        else:
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)  # LINE:update
        model.zero_grad()
        done += 1
        print(loss.item())  # LINE:item
finally:
    open("finally.txt", "w").write(str(done))
'''


PROGRAMS = {
    # (20 steps of 2 epochs of 16: the eval loop after the first epoch runs between steps, read by
    # test_the_eval_loop_is_outside_the_steps from this row's audit)
    "epochs-eval": Program(EPOCHS_EVAL, ("--steps", "20", "--", "--epochs", "2"), 20, "optimizer",
                           {"host-sync": "item", "dataloader-bound": "loader"}),
    "epochs-eval-to-end": Program(EPOCHS_EVAL, ("--steps", "6", "--to-end", "--", "--epochs", "2"), 32,
                                  "optimizer", ended_by_audit=False),
    "while-accumulate": Program(WHILE_ACCUMULATE, ("--steps", "5"), 5, "optimizer"),
    "gan": Program(GAN, ("--steps", "5"), 5, "optimizer"),
    "gan-skip-to-end": Program(GAN, ("--steps", "5", "--skip", "3", "--to-end"), 29, "optimizer",
                               ended_by_audit=False),
    "exits-3": Program(EXITS_3, ("--steps", "10"), 4, "optimizer", files=("finally.txt", "atexit.txt"),
                       exit_code=3, ended_by_audit=False),
    "grad-scaler": Program(GRAD_SCALER, ("--steps", "8"), 8, "optimizer"),
    "marker": Program(MARKER, ("--steps", "6"), 6, "marker", {"host-sync": "float"}),
    "compiled-optimizer-step": Program(COMPILED_STEP, ("--steps", "5"), 5, "optimizer", numerics=True),
    # (without numerics the probes alone read the compiled steps: at the next backward pass)
    "compiled-optimizer-step-no-numerics": Program(COMPILED_STEP, ("--steps", "5"), 5, "optimizer", slow=True),
    "gan-without-loader": Program(GAN_NO_LOADER, ("--steps", "5"), 5, "optimizer"),
    "custom-update": Program(CUSTOM_UPDATE, ("--steps", "6"), 6, "dataloader"),
    "manual-update": Program(MANUAL_UPDATE, ("--steps", "6"), 6, "update", {"host-sync": "item"}, numerics=True),
    "no-grad-update": Program(MANUAL_UPDATE, ("--steps", "6", "--", "--no-grad-update"), 6, "update"),
    "manual-update-accumulate": Program(MANUAL_UPDATE, ("--steps", "5", "--", "--accumulate", "3"), 5, "update"),
    "manual-update-to-end": Program(MANUAL_UPDATE, ("--steps", "4", "--to-end"), 399, "update", ended_by_audit=False),
}


def _line(source: str, tag: str) -> int:
    # (the file is written with END first: its lines count)
    return next(i for i, line in enumerate(source.splitlines(), 1) if f"# LINE:{tag}" in line)


@pytest.fixture(scope="module")
def program_audit(tmp_path_factory):
    """Each row's program audited once in a directory of its own (the files it writes land there):
    the row's test and the tests that read more of the same run share it."""
    done = {}

    def get(name: str):
        if name not in done:
            p = PROGRAMS[name]
            d = tmp_path_factory.mktemp(name)
            (d / "train.py").write_text(p.source)
            args = list(p.args)
            at = args.index("--") if "--" in args else len(args)
            args[at:at] = ["--no-profile", "--quiet"] + ([] if p.numerics else ["--no-numerics"])
            done[name] = audit("run", str(d / "train.py"), *args, out=d / "out", cwd=d), d
        return done[name]

    return get


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if p.slow else n
                                  for n, p in PROGRAMS.items()])
def test_a_program_runs_as_python_runs_it(program_audit, name):
    p = PROGRAMS[name]
    a, tmp_path = program_audit(name)
    assert a.returncode == p.exit_code, a.stderr[-3000:]
    ev = a.evidence
    assert len(ev["steps"]) == p.steps, [s["index"] for s in ev["steps"]]
    assert ev["program"]["steps_by"] == p.steps_by
    assert ev["program"]["ended_by_audit"] is p.ended_by_audit
    for rule, tag in p.findings.items():
        lines = [loc["line"] for f in a.rule(rule) for loc in f["locations"][:1]]
        assert _line(p.source, tag) in lines, (rule, lines, [f["rule"] for f in a.findings])
    for f in p.files:
        assert (tmp_path / f).is_file(), f"{f} not written"
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert f"steps: {ev['program']['steps_found']}" in summary
    if p.ended_by_audit:
        assert f"the audit ended the program after {p.steps} step(s)" in summary
    if p.exit_code:
        assert f"exited with code {p.exit_code}" in summary


def test_the_readme_first_command(tmp_path):
    """examples/train_script.py, a plain script, audited as the README's first command does, its
    findings at the lines it marks; the log its finally block writes holds the audited steps."""
    log = tmp_path / "log.json"
    a = audit("run", "examples/train_script.py", "--steps", "12", "--no-profile", "-q", "--", "--epochs", "1",
              "--log", str(log), out=tmp_path / "o")
    assert a.returncode == 0, a.stderr[-3000:]
    assert len(a.evidence["steps"]) == 12 and a.evidence["program"]["ended_by_audit"]
    for rule in ("dataloader-bound", "host-sync"):
        lines = {loc["line"] for f in a.rule(rule) for loc in f["locations"][:1]}
        assert set(expected_lines(EXAMPLES / "train_script.py", rule)) <= lines, (rule, lines)
    assert len(json.loads(log.read_text())) == 12


def test_gan_and_accumulation_steps_hold_whole_iterations(program_audit):
    """A GAN's D and G steps are one step; 4 accumulated micro-batches are one step (the table's
    audits of both programs, 5 steps each)."""
    a, _ = program_audit("gan")
    assert a.returncode == 0, a.stderr[-3000:]
    assert len(a.evidence["steps"]) == 5
    for s in a.evidence["steps"]:
        opts = sorted(t["what"] for t in s["tallies"] if t["kind"] == "optimizer")
        assert opts == ["Adam", "SGD"], opts
        # (the backward passes are tallied in their step: the step finder's own wrapper around
        # backward hid them from the probe)
        assert sum(t["count"] for t in s["tallies"] if t["kind"] == "backward") == 2
    assert "2 per iteration" in a.evidence["program"]["steps_found"]
    a, d = program_audit("while-accumulate")
    assert a.returncode == 0, a.stderr[-3000:]
    assert len(a.evidence["steps"]) == 5
    for s in a.evidence["steps"]:
        assert sum(t["count"] for t in s["tallies"] if t["kind"] == "forward") == 4
        assert sum(t["count"] for t in s["tallies"] if t["kind"] == "backward") == 4
    assert (d / "finally.txt").read_text() == "20"  # (ended at the first forward after the 5th step)


def test_an_update_outside_torch_optim_marks_whole_iterations(program_audit):
    """A language model whose weights are updated by hand (word_language_model's
    `p.data.add_(p.grad, alpha=-lr)`, or `p -= lr * p.grad` under no_grad), with no DataLoader
    and an optimizer named but never made: each iteration is a step, from its forward pass, with
    its one backward pass and its update (3 micro-batches a step where it accumulates); the audit
    ends the program after --steps of them, at the next iteration's forward: the updates the
    program made (finally.txt) are the steps'."""
    for name, micro in (("manual-update", 1), ("no-grad-update", 1), ("manual-update-accumulate", 3)):
        a, d = program_audit(name)
        assert a.returncode == 0, (name, a.stderr[-3000:])
        steps = a.evidence["steps"]
        assert "weight updates outside torch.optim" in a.evidence["program"]["steps_found"]
        for s in steps:
            kinds = {}
            for t in s["tallies"]:
                kinds[t["kind"]] = kinds.get(t["kind"], 0) + t["count"]
            assert kinds.get("backward") == micro, (name, s["index"], kinds)
            forwards = [t for t in s["tallies"] if t["kind"] == "forward" and t["what"] == "LM"]
            assert sum(t["count"] for t in forwards) == micro, (name, s["index"])
            # (one update a step: clip_grad_norm_'s norm, the loss's .item() at the step's end)
            item = [t for t in s["tallies"] if t["what"] == "Tensor.item"]
            assert [t["where"]["line"] for t in item] == [_line(MANUAL_UPDATE, "item")], (name, s["index"])
        assert int((d / "finally.txt").read_text()) == len(steps), name
    a, d = program_audit("manual-update-to-end")  # (the run's 399 updates, its last step closed at its end)
    assert int((d / "finally.txt").read_text()) == 399


def test_the_eval_loop_is_outside_the_steps(program_audit):
    a, tmp_path = program_audit("epochs-eval")  # (20 steps, 2 epochs of 16)
    assert a.returncode == 0, a.stderr[-3000:]
    ev = a.evidence
    between = [o for o in ev["outside"] if o["phase"] == "between"]
    assert between and between[0]["after_step"] == 15  # (16 batches an epoch)
    eval_line = _line(EPOCHS_EVAL, "eval-item")
    assert any(t["where"] and t["where"]["line"] == eval_line for t in between[0]["tallies"])
    assert not any(t["where"] and t["where"]["line"] == eval_line for s in ev["steps"] for t in s["tallies"])
    # the eval loop's sync is reported with its phase, apart from the step's
    outside = [f for f in a.rule("host-sync") if f["evidence"].get("phase") == "between"]
    assert [loc["line"] for f in outside for loc in f["locations"]] == [eval_line]
    # under torch.no_grad(): named an evaluation loop
    [f] = outside
    assert f["evidence"]["evaluation"] is True and f["evidence"]["sites"][0]["under_no_grad"] is True
    assert "between steps in an evaluation loop (under torch.no_grad())" in f["message"]
    assert (tmp_path / "finally.txt").read_text() == "20"


def test_a_package_module_with_relative_imports_and_stdin(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text("import torch\ndef make():\n    return torch.nn.Linear(4, 1)\n")
    (pkg / "train.py").write_text(END + textwrap.dedent('''
        import os, sys
        import torch
        from .model import make
        name = sys.stdin.readline().strip()
        open("seen.txt", "w").write(repr([name, sys.argv[1:], sys.path[0] == os.getcwd(), __name__,
                                          __package__, os.path.basename(sys.argv[0])]))
        m = make()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for i in range(int(sys.argv[1])):
            m(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    '''))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "auditor", "run", "-m", "pkg.train", "--steps", "3", "--no-profile",
                        "--no-numerics", "-q", "--out", str(tmp_path / "o"), "--", "10"],
                       input="from-stdin\n", capture_output=True, text=True, cwd=tmp_path, env=env, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert eval((tmp_path / "seen.txt").read_text()) == ["from-stdin", ["10"], True, "__main__", "pkg", "train.py"]
    assert (tmp_path / "atexit.txt").is_file()
    a = audit("run", "-m", "pkg.nothing", out=tmp_path / "n", cwd=tmp_path)
    assert a.returncode == 2 and "no such module: pkg.nothing" in a.stderr


def test_a_script_sees_its_own_name_and_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "helper.py").write_text("X = 1\n")
    (tmp_path / "sub" / "prog.py").write_text(textwrap.dedent('''
        import os, sys
        import helper
        open("seen.txt", "w").write(repr([__name__, sys.argv, os.path.isabs(__file__),
                                          sys.path[0] == os.path.dirname(__file__)]))
    '''))
    a = audit("run", "sub/prog.py", "-q", "--", "a", "--b", out=tmp_path / "o", cwd=tmp_path)
    assert a.returncode == 0, a.stderr[-3000:]
    assert eval((tmp_path / "seen.txt").read_text()) == ["__main__", ["sub/prog.py", "a", "--b"], True, True]
    assert a.evidence["program"]["steps_by"] == "none"


@pytest.mark.slow
def test_a_step_file_is_main_file_and_spawn_workers_do_not_rerun_it(tmp_path):
    """`file.py:step`: `__main__.__file__` is the step file's, as the script's in a plain run (it
    was the auditor's child's); a spawn DataLoader worker still does not rerun the file's setup."""
    (tmp_path / "t.py").write_text(textwrap.dedent('''
        import sys
        import torch
        from torch.utils.data import DataLoader, TensorDataset
        open("setups.txt", "a").write("setup\\n")
        open("main.txt", "w").write(sys.modules["__main__"].__file__)
        loader = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4, num_workers=1,
                            multiprocessing_context="spawn")

        def step():
            for (x,) in loader:
                x.sum()
    '''))
    a = audit("run", "t.py:step", "--steps", "2", "--no-profile", "--no-numerics", "-q", out=tmp_path / "o",
              cwd=tmp_path, timeout=180)
    assert a.returncode == 0, a.stderr[-3000:]
    assert (tmp_path / "main.txt").read_text() == str(tmp_path / "t.py")
    assert (tmp_path / "setups.txt").read_text() == "setup\n"


@pytest.fixture(scope="module")
def program_end(tmp_path_factory):
    """PROGRAM_END audited as `t.py:step` (3 steps, in the directory its files land in)."""
    d = tmp_path_factory.mktemp("program_end")
    (d / "t.py").write_text(PROGRAM_END)
    return audit("run", "t.py:step", "--steps", "3", "--no-profile", "-q", out=d / "o", cwd=d), d


def test_a_step_callable_runs_atexit_handlers(program_end):
    """`file.py:callable` ends as Python ends a program too: its atexit handlers run (END's, in
    PROGRAM_END, audited once for this test and the next)."""
    a, tmp_path = program_end
    assert a.returncode == 0, a.stderr[-3000:]
    assert (tmp_path / "atexit.txt").read_text() == "atexit"


@pytest.mark.slow
def test_a_thread_that_never_ends_does_not_hang_the_audit(tmp_path):
    """The program's end is bounded: a non-daemon thread left running ends the process
    AUDIT_EXIT_GRACE_S (60 s unless set) later; a program whose end takes longer sets it higher."""
    (tmp_path / "t.py").write_text(textwrap.dedent('''
        import threading, time
        threading.Thread(target=lambda: time.sleep(3600)).start()
    '''))
    started = time.monotonic()
    a = audit("run", "t.py", "-q", out=tmp_path / "o", cwd=tmp_path, timeout=180,
              env={**os.environ, "AUDIT_EXIT_GRACE_S": "4"})
    assert a.returncode == 0, a.stderr[-3000:]
    assert "had not ended 4 s after its run" in a.stderr
    assert time.monotonic() - started < 60


PROGRAM_END = END + '''
import logging, logging.handlers, multiprocessing as mp, threading, time
import torch
log = open("log.txt", "w")  # buffered and never closed: Python flushes it as the program ends
logging.getLogger("t").addHandler(logging.handlers.MemoryHandler(1000, target=logging.FileHandler("mem.txt")))
logging.getLogger("t").setLevel(logging.INFO)
w = torch.ones(4)

def late(path):
    time.sleep(1.5)
    open(path, "w").write("done")

def step(i):
    w.add_(1)
    log.write(f"step {i}\\n")
    logging.getLogger("t").info("step %d", i)
    if i == 1:
        threading.Thread(target=late, args=("thread.txt",)).start()
        mp.get_context("fork").Process(target=late, args=("child.txt",)).start()
'''


def test_the_program_ends_as_python_ends_it(program_end):
    """After the audit the program's end is a plain run's: its open files are flushed, logging's
    shutdown writes a MemoryHandler's records to its target, a non-daemon thread and a non-daemon
    multiprocessing child still running are waited for (the child ended with os._exit: 0-byte
    log, empty target, neither file)."""
    a, tmp_path = program_end
    assert a.returncode == 0, a.stderr[-3000:]
    assert (tmp_path / "log.txt").read_text() == "step 0\nstep 1\nstep 2\n"
    assert (tmp_path / "mem.txt").read_text() == "step 0\nstep 1\nstep 2\n"
    assert (tmp_path / "thread.txt").read_text() == "done" and (tmp_path / "child.txt").read_text() == "done"


def test_persistent_forkserver_workers_do_not_keep_the_output_pipe_open(tmp_path):
    """`audit run ... | cat` with a forkserver DataLoader of persistent workers: the workers end
    with the program, so whoever reads audit's stdout sees its end (it hung: the workers, left
    alive, held the pipe). capture_output reads to the end of the pipe, as `cat` does."""
    (tmp_path / "dl.py").write_text(textwrap.dedent('''
        import torch
        from torch.utils.data import DataLoader, TensorDataset
        loader = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4, num_workers=2,
                            persistent_workers=True, multiprocessing_context="forkserver")
        it = iter(loader)

        def step():
            next(it)
    '''))
    a = audit("run", "dl.py:step", "--steps", "4", "--no-profile", "-q", out=tmp_path / "o", cwd=tmp_path, timeout=120)
    assert a.returncode == 0, a.stderr[-3000:]


def test_a_program_that_makes_no_optimizer_is_read_from_its_own_modules(tmp_path):
    """makes_no_optimizer reads the target and the user's modules it imports: an optimizer made in
    an imported module of the user's, a framework's Trainer, or a GradScaler counts; a hand-written
    update does not."""
    from auditor.capture.steps import makes_no_optimizer

    (tmp_path / "custom.py").write_text(CUSTOM_UPDATE)
    assert makes_no_optimizer(str(tmp_path / "custom.py"))
    (tmp_path / "mytrainer.py").write_text("import torch\ndef make(m):\n    return torch.optim.AdamW(m.parameters())\n")
    (tmp_path / "uses.py").write_text("import torch\nfrom mytrainer import make\n")
    assert not makes_no_optimizer(str(tmp_path / "uses.py"))
    for source in ("import lightning as L\n", "from transformers import Trainer\n",
                   "import torch\ns = torch.amp.GradScaler()\n", "from accelerate import Accelerator\n",
                   "cfg = {'opt': 'torch.optim.SGD'}\n"):
        (tmp_path / "p.py").write_text(source)
        assert not makes_no_optimizer(str(tmp_path / "p.py")), source
    (tmp_path / "z.zip").write_bytes(b"PK")
    assert not makes_no_optimizer(str(tmp_path / "z.zip"))
