"""CUDA rehearsal (issue 4): GPU trainers audited on a machine without a GPU, for real, through the CLI.

Each examples/gpu_*.py is written the way GPU users write trainers and marks its offending lines
with `# expect: rule-id`; rehearsal must find exactly those, judged as GPU code (syncs at full
severity, costs counted not timed), compute the same numbers as the program's CPU version, and
stay out of the way of programs that never asked for CUDA.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from auditor.capture.rehearsal.intent import argument_reason, cuda_reasons, program_reasons
from auditor.evidence import model as m
from auditor.reports.terminal import NO_GPU_ERRORS
from auditor.rules.pageable_copy import rehearsal_findings as pageable_rehearsal_findings
from auditor.rules.registry import all_rules
from conftest import EXAMPLES, FIXTURES, Audit, audit, expected_lines, patch_text, shared, graded_severity

# what a CUDA build of torch says where there is no GPU (no driver; no visible device), among the
# errors the summary's --rehearse hint knows
CUDA_BUILD_NO_GPU = ("Found no NVIDIA driver on your system", "No CUDA GPUs are available")
assert set(CUDA_BUILD_NO_GPU) <= set(NO_GPU_ERRORS)

if torch.cuda.is_available():  # pragma: no cover - rehearsal is for machines without a GPU
    pytest.skip("a CUDA device is present: nothing to rehearse", allow_module_level=True)

STEPS = 10
ANNOUNCE = re.compile(r"^audit: no CUDA device here: rehearsing", re.M)
# Fewer threads, steadier step times on a busy machine; both runs of a parity check use the same.
QUIET_ENV = {"OMP_NUM_THREADS": "1"}
# Examples whose weights are also compared with their CPU version: audited through a wrapper that
# saves the trained state (with --rehearse, since the wrapper itself does not ask for CUDA).
PARITY = ("gpu_cuda_everywhere", "gpu_amp", "gpu_default_device")
WRAPPER = '''
import os, sys
sys.path.insert(0, {examples!r})
import torch
import {name} as trainer

def step(i):
    trainer.step(i)
    if i == {last}:
        state = {{"model": trainer.model.state_dict(), "opt": trainer.opt.state_dict()}}
        torch.save(state, os.environ["PARITY_OUT"])

if __name__ == "__main__":
    for i in range({steps}):
        step(i)
'''


@pytest.fixture(scope="session")
def rehearsed(tmp_path_factory):
    """Audit each GPU example once. Those in PARITY go through a wrapper with --rehearse and leave
    their trained state in `state.pt` next to the run; the others are audited as they are, in auto mode."""
    def make(name: str, out: Path) -> Audit:
        out.mkdir(parents=True, exist_ok=True)
        profile = ("--no-profile",)  # the profiler sees nothing rehearsal-specific, and costs ~10 s a run
        if name in PARITY:
            wrapper = out / f"wrap_{name}.py"
            wrapper.write_text(WRAPPER.format(examples=str(EXAMPLES), name=name, last=STEPS - 1, steps=STEPS))
            return audit("run", f"{wrapper}:step", "--steps", str(STEPS), "--rehearse", "--quiet", *profile,
                         out=out / "run", env={**QUIET_ENV, "PARITY_OUT": str(out / "state.pt")})
        return audit("run", f"examples/{name}.py:step", "--steps", str(STEPS), "--quiet", *profile,
                     out=out / "run", env=QUIET_ENV)

    return lambda name: shared(tmp_path_factory, f"rehearse-{name}", lambda d: make(name, d))


def located(a, name: str, rule_id: str) -> dict:
    """The one finding of `rule_id`, located at least at every line marked for it."""
    assert a.returncode == 0, a.stderr
    found = a.rule(rule_id)
    assert len(found) == 1, [(f["rule"], f["message"]) for f in a.findings]
    f = found[0]
    path = EXAMPLES / f"{name}.py"
    lines = expected_lines(path, rule_id)
    assert lines, "example has no # expect marker"
    assert {(loc["file"], loc["line"]) for loc in f["locations"]} >= {(str(path), n) for n in lines}
    return f


def tallies(a, kind: str, setup: bool = False) -> list[dict]:
    out = [t for t in a.evidence["setup"] if t["kind"] == kind] if setup else []
    return out + [t for s in a.evidence["steps"] for t in s["tallies"] if t["kind"] == kind]


# The rules rehearsal feeds; other rules (e.g. timing trends) judge CPU timings as on any CPU run.
JUDGED_AS_GPU = {"host-sync", "pageable-copy", "dataloader-on-device", "peak-stats-reset"}


def gpu_warnings(a) -> set[str]:
    return {f["rule"] for f in a.findings if f["severity"] != "info" and f["rule"] in JUDGED_AS_GPU}


# --- when to rehearse ----------------------------------------------------------------------------

@pytest.mark.parametrize("source,asks", [
    ("x = x.cuda()", ".cuda()"),
    ("model.to('cuda:1')", '"cuda:1"'),
    ("dev = torch.device('cuda')", '"cuda"'),
    ("ok = torch.cuda.is_available()", "torch.cuda.is_available"),
    ("torch.set_default_device(dev)", "set_default_device"),
    ("from torch.cuda.amp import autocast", "from torch.cuda.amp import ..."),
    ("torch.cuda.reset_peak_memory_stats()\ntorch.cuda.empty_cache()", None),  # runs on a CPU anyway
    ("torch.set_default_device('cpu')", None),
    ("device = torch.accelerator.current_accelerator()", "torch.accelerator.current_accelerator"),
    ("use = torch.accelerator.is_available()", "torch.accelerator.is_available"),
    ("from torch.accelerator import current_accelerator", "from torch.accelerator import ..."),
    ("torch.accelerator.empty_cache()\nn = torch.accelerator.memory_allocated()", None),  # the memory family
    ("# put it on cuda later\nprint('cuda is fast')", None),
    # a seeding helper's lines run on a CPU anyway (karpathy/makemore seeds CUDA on every device)
    ("torch.cuda.manual_seed_all(0)\ntorch.cuda.manual_seed(0)\ntorch.cuda.seed_all()", None),
    ("from torch.cuda import manual_seed_all", None),
    # a device tested against "cuda" is not asked for it (makemore: `if args.device.startswith('cuda')`)
    ("if args.device.startswith('cuda'):\n    pass\nok = device == 'cuda'\nuse = 'cuda' in str(dev)\n"
     "no = device.type != 'cuda:0'\nboth = dev.endswith(('cuda', 'mps'))", None),
    ("dev = 'cuda' if ok else 'cpu'", '"cuda"'),  # (chosen, not tested)
    ("if args.device == 'cuda':\n    x = x.cuda()", ".cuda()"),
    ("torch.cuda.manual_seed_all(0)\nuse = torch.cuda.is_available()", "torch.cuda.is_available"),
    ("x = torch.randn(3)", None),
])
def test_auto_mode_reads_whether_the_file_asks_for_cuda(tmp_path, source, asks):
    f = tmp_path / "t.py"
    f.write_text(source + "\n")
    reasons = cuda_reasons(f)
    assert (reasons[0][1] if reasons else None) == asks


@pytest.mark.parametrize("argv,asks", [
    (["--device", "cuda"], "'cuda'"),
    (["-i", "names.txt", "--device=cuda:1"], "'--device=cuda:1'"),
    (["cuda:0"], "'cuda:0'"),
    (["--device", "cpu", "--note", "cuda is fast", "--cuda-graphs"], None),
    ([], None),
])
def test_an_argument_that_names_a_cuda_device_asks_for_it(argv, asks):
    assert argument_reason(argv) == asks


@pytest.mark.parametrize("name", ["clean", "peak_stats_reset", "forced_cleanup", "host_sync"])
def test_cpu_examples_are_not_rehearsed_in_auto_mode(name):
    assert cuda_reasons(EXAMPLES / f"{name}.py") == []


def test_auto_mode_leaves_a_cpu_program_alone(example_audit):
    a = example_audit("clean")  # (the session's audit of the clean example, shared with the rules' tests)
    assert a.returncode == 0, a.stderr
    env = a.findings_doc["environment"]
    assert env["rehearsal"] is False and not any("rehearsal" in n for n in env["notes"])
    assert not ANNOUNCE.search(a.stderr)


def test_no_rehearse_fails_as_on_a_cpu_box(tmp_path):
    a = audit("run", "examples/gpu_cuda_everywhere.py:step", "--steps", "1", "--no-rehearse", "--no-profile",
              "--quiet", out=tmp_path / "out")
    assert a.returncode == 3, a.stderr
    ending = a.evidence["ending"]
    # a CPU build of torch refuses `.cuda()` as not compiled with CUDA; a CUDA build (PyPI's Linux
    # wheels) finds no driver or no device: texts the summary's --rehearse hint knows, as it does this one
    assert ending["status"] == "raised"
    assert ("not compiled with CUDA" in ending["message"] if torch.version.cuda is None
            else any(text in ending["message"] for text in CUDA_BUILD_NO_GPU)), ending["message"]
    source = (EXAMPLES / "gpu_cuda_everywhere.py").read_text().splitlines()
    assert source[ending["where"]["line"] - 1].startswith("model = ")  # its module-level `.cuda()`
    assert not ANNOUNCE.search(a.stderr)


# --- the whole program's intent: imported modules, torch.accelerator ------------------------------

def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def _line(text: str, needle: str) -> int:
    [n] = [i for i, line in enumerate(text.splitlines(), 1) if needle in line]
    return n


def test_the_program_is_read_through_its_imports_transitively(tmp_path, monkeypatch):
    """main -> util (a cycle back to main) -> pkg.deep (relative import of .conf) -> conf asks for
    CUDA; an installed module on sys.path that asks for CUDA is not the program's."""
    site = tmp_path / "lib" / "site-packages"
    _write(site, {"installed.py": "import torch\nd = torch.device('cuda')\n"})
    _write(tmp_path / "proj", {
        "main.py": "import util\nimport installed\n",
        "util.py": "import main\nfrom pkg import deep\n",
        "pkg/__init__.py": "",
        "pkg/deep.py": "from .conf import DEVICE\n",
        "pkg/conf.py": "import torch\n\nDEVICE = torch.device('cuda:0')\n",
    })
    monkeypatch.setattr(sys, "path", [sys.path[0], str(site), *sys.path[1:]])
    found = program_reasons(str(tmp_path / "proj" / "main.py"))
    assert [(Path(f).name, line, what) for f, line, what in found] == [("conf.py", 3, '"cuda:0"')]
    monkeypatch.chdir(tmp_path / "proj")
    assert [(Path(f).name, line) for f, line, _ in program_reasons(None, "pkg.deep")] == [("conf.py", 3)]


# A trainer library of the user's own, as minGPT's trainer.py: the device is chosen there.
TRAINER_MODULE = """import torch
import torch.nn.functional as F


class Trainer:
    def __init__(self, model, data):
        self.device = "cpu"
        if torch.cuda.is_available():
            self.device = torch.cuda.current_device()
        self.model = model.to(self.device)
        self.data = data
        self.opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def run(self, epochs):
        for _ in range(epochs):
            for x, y in self.data:
                x, y = x.to(self.device), y.to(self.device)
                self.opt.zero_grad()
                F.cross_entropy(self.model(x), y).backward()
                self.opt.step()
"""
MAIN_OF_TRAINER = """import torch
from torch import nn

from trainer import Trainer

if __name__ == "__main__":
    torch.manual_seed(0)
    data = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(6)]
    Trainer(nn.Linear(16, 4), data).run(epochs=2)
"""


def test_cuda_asked_for_in_an_imported_user_module_is_rehearsed(tmp_path):
    """The main file never names CUDA; its trainer module (beside it) asks `torch.cuda.is_available()`
    and moves the model and batches to the device it picks. Only the target file was read: the
    program ran unrehearsed, on the CPU, as a CPU program (no copy to any GPU counted)."""
    _write(tmp_path, {"main.py": MAIN_OF_TRAINER, "trainer.py": TRAINER_MODULE})
    a = audit("run", str(tmp_path / "main.py"), "--steps", "3", "--no-profile", "--quiet", out=tmp_path / "out",
              cwd=tmp_path)
    assert a.returncode == 0, a.stderr[-3000:]
    line = _line(TRAINER_MODULE, "if torch.cuda.is_available()")
    assert f"(torch.cuda.is_available at line {line} of trainer.py)" in a.stderr
    env = a.findings_doc["environment"]
    assert env["rehearsal"] is True and any(f"line {line} of trainer.py" in n for n in env["notes"])
    copies = [t for s in a.evidence["steps"] for t in s["tallies"] if t["kind"] == m.H2D_COPY]
    assert len(a.evidence["steps"]) == 3 and copies
    assert {t["where"]["line"] for t in copies} == {_line(TRAINER_MODULE, "x, y = x.to(self.device)")}


# karpathy/makemore's shape: the device is a flag (default cpu), CUDA is seeded on every device and
# synchronised when the device's name starts with "cuda"
DEVICE_FLAG = """import argparse
import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--device", type=str, default="cpu", help="examples: cpu|cuda|cuda:2|mps")
args = parser.parse_args()
torch.manual_seed(0)
torch.cuda.manual_seed_all(0)
model = nn.Linear(16, 4).to(args.device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(5):
    x = torch.randn(8, 16).to(args.device)
    loss = model(x).pow(2).mean()
    model.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
"""


def test_a_device_flag_is_rehearsed_when_the_command_line_names_cuda(tmp_path):
    """Run as its README runs it (the CPU by default), the program is a CPU program: its seeding of
    CUDA and its test of the device's name ask for nothing, and it is audited as it runs. With
    `--device cuda` on its command line it is rehearsed, and its batches' copies to the GPU counted."""
    _write(tmp_path, {"main.py": DEVICE_FLAG})
    plain = audit("run", str(tmp_path / "main.py"), "--steps", "3", "--no-profile", "--quiet", out=tmp_path / "cpu",
                  cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert plain.findings_doc["environment"]["rehearsal"] is False and not ANNOUNCE.search(plain.stderr)
    a = audit("run", str(tmp_path / "main.py"), "--steps", "3", "--no-profile", "--quiet", "--", "--device", "cuda",
              out=tmp_path / "cuda", cwd=tmp_path)
    assert a.returncode == 0, a.stderr[-3000:]
    assert "(the argument 'cuda' on its command line)" in a.stderr
    assert a.findings_doc["environment"]["rehearsal"] is True
    copies = [t for s in a.evidence["steps"] for t in s["tallies"] if t["kind"] == m.H2D_COPY]
    assert {t["where"]["line"] for t in copies} == {_line(DEVICE_FLAG, "x = torch.randn(8, 16).to(args.device)")}


# pytorch/examples dcgan's shape: the source picks CUDA when a flag of its own asks for it
GPU_FLAG = """import argparse
import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--gpu", action="store_true")
args = parser.parse_args()
device = torch.device("cuda" if args.gpu and torch.cuda.is_available() else "cpu")
model = nn.Linear(16, 4).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(5):
    x = torch.randn(8, 16).to(device)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_a_rehearsal_that_saw_no_gpu_work_says_so(tmp_path):
    """Its source asks for CUDA, so it is rehearsed either way; without `--gpu` the run keeps every
    tensor on the CPU and the summary says that no GPU cost was counted; with it, the batches'
    copies are counted and the line is not there."""
    _write(tmp_path, {"main.py": GPU_FLAG})
    said = "CUDA rehearsal: this run put no tensor on the GPU"
    runs = {}
    for name, argv in (("cpu", ()), ("gpu", ("--", "--gpu"))):
        a = audit("run", str(tmp_path / "main.py"), "--steps", "3", "--no-profile", *argv, out=tmp_path / name,
                  cwd=tmp_path)
        assert a.returncode == 0, a.stderr[-3000:]
        assert a.findings_doc["environment"]["rehearsal"] is True
        runs[name] = (a, (tmp_path / name / "summary.txt").read_text())
    assert said in runs["cpu"][1] and said not in runs["gpu"][1]
    copies = [t for s in runs["gpu"][0].evidence["steps"] for t in s["tallies"] if t["kind"] == m.H2D_COPY]
    assert copies and not [t for s in runs["cpu"][0].evidence["steps"] for t in s["tallies"]
                           if t["kind"] == m.H2D_COPY]


def test_a_rehearsal_on_the_cpu_its_command_line_asks_for_names_that_setting(tmp_path):
    """nanoGPT as its README runs it on a CPU (`--device=cpu`): its source asks for CUDA, so it is
    rehearsed, and the run stays on the CPU. The line said to pass `--device cuda`, a form nanoGPT's
    configurator takes for a config file's name; it names the program's own `--device=cpu` and
    `--device=cuda` in its place."""
    source = DEVICE_FLAG.replace("default=\"cpu\"", "default=\"cuda\"").replace(
        "args = parser.parse_args()", "args = parser.parse_args([a for b in sys.argv[1:] for a in b.split('=', 1)])")
    _write(tmp_path, {"main.py": "import sys\n" + source})
    a = audit("run", str(tmp_path / "main.py"), "--steps", "3", "--no-profile", "--", "--device=cpu",
              out=tmp_path / "out", cwd=tmp_path)
    assert a.returncode == 0, a.stderr[-3000:]
    assert a.findings_doc["environment"]["rehearsal"] is True
    [line] = [ln for ln in (tmp_path / "out" / "summary.txt").read_text().splitlines()
              if ln.startswith("CUDA rehearsal: this run put no tensor on the GPU")]
    assert "as its `--device=cpu` asks" in line and "Run it with `--device=cuda` in its place" in line, line


# PyTorch's own examples (mnist, word_language_model, ...) pick the device through torch.accelerator.
ACCELERATOR_PROGRAM = """import argparse

import torch
import torch.nn.functional as F
from torch import nn


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--no-accel", action="store_true")
    args = parser.parse_args()
    use_accel = not args.no_accel and torch.accelerator.is_available()
    device = torch.accelerator.current_accelerator() if use_accel else torch.device("cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(16, 32), torch.randint(0, 4, (16,))) for _ in range(6)]
    for epoch in range(args.epochs):
        for x, y in data:
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    torch.accelerator.synchronize()


if __name__ == "__main__":
    main()
"""


def _has_accelerator(*names: str) -> bool:
    accelerator = getattr(torch, "accelerator", None)  # (torch 2.6 on; device_index, the memory family later)
    return accelerator is not None and all(hasattr(accelerator, n) for n in names)


@pytest.mark.skipif(not _has_accelerator("is_available", "current_accelerator", "synchronize"),
                    reason="this torch has no torch.accelerator API for a program to use")
def test_a_torch_accelerator_program_is_rehearsed_as_cuda(tmp_path):
    """`torch.accelerator.is_available()` / `current_accelerator()` ask for the machine's
    accelerator: rehearsed, they answer as on a one-GPU CUDA machine, so the program's
    `.to(device)` are host-to-GPU copies (2 a step) and its closing synchronize() is a device sync.
    Before, the program was not rehearsed: its device was the CPU and nothing was a GPU copy."""
    _write(tmp_path, {"mnist_like.py": ACCELERATOR_PROGRAM})
    a = audit("run", str(tmp_path / "mnist_like.py"), "--to-end", "--no-profile", "--quiet", "--",
              "--epochs", "1", out=tmp_path / "out", cwd=tmp_path)
    assert a.returncode == 0, a.stderr[-3000:]
    asks = _line(ACCELERATOR_PROGRAM, "torch.accelerator.is_available()")
    assert f"(torch.accelerator.is_available at line {asks} of mnist_like.py)" in a.stderr
    ev = a.evidence
    assert ev["environment"]["rehearsal"] is True and len(ev["steps"]) == 6
    standins = {(t["what"], t["where"]["line"]) for t in ev["setup"] if t["kind"] == "cuda-standin"}
    assert standins >= {("torch.accelerator.is_available", asks),
                        ("torch.accelerator.current_accelerator", _line(ACCELERATOR_PROGRAM, "current_accelerator()"))}
    copy_line = _line(ACCELERATOR_PROGRAM, "x, y = x.to(device), y.to(device)")
    in_steps = [(t["what"], t["where"]["line"]) for s in ev["steps"] for t in s["tallies"] if t["kind"] == m.H2D_COPY]
    in_setup = [(t["what"], t["where"]["line"]) for t in ev["setup"] if t["kind"] == m.H2D_COPY]
    assert set(in_steps) == {("Tensor.to(cuda)", copy_line)}
    assert (in_steps + in_setup).count(("Tensor.to(cuda)", copy_line)) == 6 * 2  # every batch's x and y
    every = [t for part in ev["steps"] + ev["outside"] for t in part["tallies"]]  # (the last step or "after")
    syncs = {(t["what"], t["where"]["line"]) for t in every if t["kind"] == m.SYNC}
    assert syncs == {("torch.accelerator.synchronize", _line(ACCELERATOR_PROGRAM, "torch.accelerator.synchronize()"))}


PACKAGE_TRAIN = """import torch
import torch.nn.functional as F

from .model import build, device


def main():
    model, opt = build()
    for i in range(5):
        x, y = torch.randn(8, 16).to(device), torch.randint(0, 4, (8,)).to(device)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


if __name__ == "__main__":
    main()
"""
PACKAGE_MODEL = """import torch
from torch import nn

device = torch.device("cuda")


def build():
    model = nn.Linear(16, 4).to(device)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)
"""


def test_a_module_program_is_rehearsed_from_its_package(tmp_path):
    """`audit run -m pkg.train`: the module's file is found without importing it, and its relative
    import `.model` (which names the device "cuda") is read. Before, a -m target was not read at all."""
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/train.py": PACKAGE_TRAIN, "pkg/model.py": PACKAGE_MODEL})
    a = audit("run", "-m", "pkg.train", "--steps", "3", "--no-profile", "--quiet", out=tmp_path / "out", cwd=tmp_path)
    assert a.returncode == 0, a.stderr[-3000:]
    assert f'("cuda" at line {_line(PACKAGE_MODEL, "torch.device(")} of model.py)' in a.stderr
    ev = a.evidence
    assert ev["environment"]["rehearsal"] is True and len(ev["steps"]) == 3
    copies = [t for s in ev["steps"] for t in s["tallies"] if t["kind"] == m.H2D_COPY]
    assert len(copies) == 6 and {t["where"]["line"] for t in copies} == {_line(PACKAGE_TRAIN, ".to(device)")}


# torch.accelerator's answers in a rehearsal: the opening of the SEMANTICS program (before it makes
# any GPU tensor, so the memory counters read 0), where this torch has all of the API it asks.
ACCELERATOR_API = ("device_index", "memory_allocated", "max_memory_allocated", "empty_cache",
                   "reset_peak_memory_stats", "set_device_index", "current_stream")
ACCELERATOR_ANSWERS = r"""
acc = getattr(torch, "accelerator", None)
if acc is not None and all(hasattr(acc, n) for n in %r):
    with acc.device_index(0):
        inside = acc.current_device_index()
    out["torch.accelerator"] = {
        "is_available": acc.is_available(), "device_count": acc.device_count(),
        "current_accelerator": str(acc.current_accelerator()), "checked": str(acc.current_accelerator(check_available=True)),
        "type": acc.current_accelerator().type, "index": acc.current_device_index(), "set": acc.set_device_index(0),
        "same_stream": acc.current_stream() is torch.cuda.current_stream(), "inside": inside,
        "memory": [acc.memory_allocated(), acc.max_memory_allocated(), acc.empty_cache(), acc.reset_peak_memory_stats()],
        "synchronize": acc.synchronize(), "tensor": str(torch.ones(2, device=acc.current_accelerator()).device),
    }
""" % (ACCELERATOR_API,)


@pytest.mark.skipif(not _has_accelerator(*ACCELERATOR_API),
                    reason="this torch has not all of the torch.accelerator API the program asks")
def test_torch_accelerator_answers_as_a_one_gpu_cuda_machine(semantics):
    """On a CPU build every torch.accelerator call but is_available() raised 'Cannot access
    accelerator device when none is available'; rehearsed, the API answers as on one CUDA GPU."""
    assert semantics["torch.accelerator"] == {
        "is_available": True, "device_count": 1, "current_accelerator": "cuda", "checked": "cuda", "type": "cuda",
        "index": 0, "set": None, "same_stream": True, "inside": 0, "memory": [0, 0, None, None],
        "synchronize": None, "tensor": "cuda:0"}


LIBRARY_MENTIONING_CUDA = """import torch


def best_device():
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
"""
CPU_PROGRAM_WITH_LIBRARY = """import torch
import torch.nn.functional as F

import fancylib

if __name__ == "__main__":
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(4):
        opt.zero_grad()
        F.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,))).backward()
        opt.step()
"""


def test_a_cpu_program_importing_an_installed_library_that_mentions_cuda_is_not_rehearsed(tmp_path):
    """An installed package (site-packages) is not the program's own code: its CUDA branch says
    nothing of what the program asks for."""
    site = tmp_path / "env" / "lib" / "python3" / "site-packages"
    _write(site, {"fancylib.py": LIBRARY_MENTIONING_CUDA})
    _write(tmp_path / "proj", {"train.py": CPU_PROGRAM_WITH_LIBRARY})
    a = audit("run", "train.py", "--steps", "2", "--no-profile", "--quiet", out=tmp_path / "out",
              cwd=tmp_path / "proj", env={"PYTHONPATH": str(site)})
    assert a.returncode == 0, a.stderr[-3000:]
    assert not ANNOUNCE.search(a.stderr)
    assert a.findings_doc["environment"]["rehearsal"] is False
    assert len(a.evidence["steps"]) == 2


# --- how tensors and torch.cuda behave in a rehearsal ----------------------------------------------

SEMANTICS = r'''
import io, json, pickle, sys
import torch
from torch import nn
from auditor.capture import probes, rehearsal
from auditor.capture.rehearsal.device import device_of
assert rehearsal.install("on", None)
probes.install()
out = {}
ACCELERATOR
x = torch.randn(4, 3)
xc = x.cuda()
out["cuda() leaves the source on the host"] = [device_of(x), device_of(xc), xc is x, xc.data_ptr() == x.data_ptr()]
out["user code sees the GPU"] = [str(xc.device), xc.is_cuda, xc.get_device(), str(x.device)]
out["marks follow ops"] = device_of((xc * 2).sum())
out["cpu() comes back to the host"] = [device_of(xc.cpu()), device_of(xc)]
out["factory device="] = [device_of(torch.zeros(2, device=d)) for d in ("cuda", 0, torch.device("cuda", 1), "cpu")]
out["to() forms"] = [device_of(t) for t in (x.to("cuda"), x.to(xc), xc.to(torch.float64), xc.to("cpu"),
                                            x.to(torch.float16))]
xt = x.type("torch.cuda.FloatTensor")
out["Tensor.type forms"] = [device_of(t) for t in (xt, x.type(torch.cuda.DoubleTensor), xt.type("torch.FloatTensor"),
                                                   xt.type(torch.float64))] + [xt.type(), x.type(), torch.equal(xt.cpu(), x)]
with torch.device("cuda"):
    inside = torch.ones(2)
out["with torch.device"] = [device_of(inside), device_of(torch.ones(2))]
m = nn.Linear(3, 2).cuda()
m(xc).sum().backward()
out["module params and grads"] = [device_of(t) for p in m.parameters() for t in (p, p.grad)]
out["nn.Parameter"] = device_of(nn.Parameter(torch.zeros(2, device="cuda")))
out["what torch puts on a GPU tensor's device"] = [
    device_of(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)),
    device_of(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, foreach=False)),
    # (torch.nn.utils.get_total_norm from torch 2.6; before, the infinity norm's path of clip_grad_norm_)
    device_of(torch.nn.utils.get_total_norm([p.grad for p in m.parameters()])
              if hasattr(torch.nn.utils, "get_total_norm")
              else torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, norm_type="inf")),
    device_of(torch.nn.utils.clip_grad_norm_(nn.Linear(2, 2).parameters(), 1.0)),  # no gradients: a host zero
    str(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0).device)]
out["Module.to with device="] = [device_of(t) for mod in (
    nn.Linear(3, 2).to(device="cuda"), nn.Linear(3, 2).to(device=torch.device("cuda"), dtype=torch.float64),
    nn.Conv2d(3, 4, 3).to(device="cuda", memory_format=torch.channels_last),
    nn.BatchNorm2d(4).to(device="cuda:0", non_blocking=True)) for t in mod.state_dict().values()]
buf = io.BytesIO()
torch.save(m.state_dict(), buf)
out["marks stay out of pickles"] = b"_auditor" in buf.getvalue() + pickle.dumps(xc)
pinned = x.pin_memory()
out["pin_memory"] = [pinned.is_pinned(), x.is_pinned(), torch.equal(pinned, x)]
try:
    xc.pin_memory()
    out["pinning a GPU tensor"] = "no error"
except RuntimeError as e:
    out["pinning a GPU tensor"] = str(e)
out["torch.cuda to the user"] = [torch.cuda.is_available(), torch.cuda.device_count(), torch.cuda.current_device(),
                                 torch.cuda.get_device_capability()]
from torch.cuda.amp.common import amp_definitely_not_available
out["torch.cuda to torch itself"] = amp_definitely_not_available()
e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
e0.record(); sum(range(100000)); e1.record()
out["Event.elapsed_time"] = e0.elapsed_time(e1) > 0
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    xs = x.cuda(non_blocking=True)
torch.cuda.current_stream().wait_stream(side)
xs.record_stream(torch.cuda.current_stream())
xs.record_stream(side)
out["streams"] = [isinstance(side, torch.Stream), str(side.device), side == torch.cuda.current_stream(),
                  side == side, device_of(xs)]
with torch.autocast("cuda"):
    out["autocast(cuda)"] = str(m(xc).dtype)
out["GradScaler(cuda)"] = torch.amp.GradScaler("cuda")._device
torch.set_default_device("cuda")
out["set_default_device(cuda)"] = [str(torch.get_default_device()), device_of(torch.empty(1)),
                                   str(torch.empty(1).device)]
torch.set_default_device(None)
from torch.utils.data import DataLoader
def refused(f):
    try:
        f()
        return "no error"
    except (RuntimeError, TypeError) as e:
        return str(e).split(" (")[0]
g = torch.Generator(device="cuda")
g.manual_seed(5)
g_host = torch.Generator()
g_host.manual_seed(5)
out["Generator(device=cuda)"] = [str(g.device), isinstance(g, torch.Generator),
                                 isinstance(torch.default_generator, torch.Generator),
                                 device_of(torch.randn(4, device=g.device, generator=g)),
                                 device_of(xc.clone().normal_(generator=g)),
                                 device_of(torch.normal(mean=xc, std=1.0, generator=g))]  # a GPU tensor by keyword
g.manual_seed(5)
out["a CUDA generator draws the CPU's numbers"] = torch.equal(torch.randn(4, device="cuda", generator=g).cpu(),
                                                              torch.randn(4, generator=g_host))
d0 = torch.cuda.default_generators[0]
d0.manual_seed(3)
torch.cuda.manual_seed(11)
out["torch.cuda.default_generators"] = [len(torch.cuda.default_generators), str(d0.device), d0.initial_seed(),
                                        torch.cuda.initial_seed(),
                                        device_of(torch.randn(2, device="cuda", generator=d0))]
out["a generator of the other device"] = [refused(lambda: torch.randn(3, generator=g)),
                                          refused(lambda: torch.randn(3, device="cuda", generator=g_host)),
                                          refused(lambda: next(iter(DataLoader(range(8), shuffle=True, generator=g))))]
torch.set_default_device("cuda")
out["shuffling under set_default_device(cuda)"] = [refused(lambda: next(iter(DataLoader(range(8), shuffle=True)))),
                                                   refused(lambda: next(iter(DataLoader(range(8), shuffle=True,
                                                                                        generator=g))))]
torch.set_default_device(None)
out["mixing GPU and host tensors"] = [refused(lambda: xc + x), refused(lambda: xc @ torch.ones(3, 2)),
                                      refused(lambda: torch.cat([xc, x])), refused(lambda: m(x)),
                                      refused(lambda: nn.functional.cross_entropy(m(xc), torch.tensor([0, 1, 0, 1]))),
                                      refused(lambda: nn.CrossEntropyLoss()(m(xc), torch.tensor([0, 1, 0, 1]))),
                                      refused(lambda: nn.Linear(3, 2)(xc)),  # the model left on the host
                                      refused(lambda: xc.numpy())]
CTC = (torch.randn(10, 4, 6, device="cuda").log_softmax(2), torch.randint(1, 6, (4, 3), device="cuda"),
       torch.full((4,), 10), torch.full((4,), 3))  # the lengths on the host, as cuDNN wants them
ctc = nn.functional.ctc_loss
out["what a GPU allows across devices"] = [refused(lambda: xc * torch.tensor(2.0)),  # a 0-dim host tensor
                                           refused(lambda: xc[torch.tensor([0, 2])]),  # host indices
                                           refused(lambda: xc.cpu().numpy()), refused(lambda: xc.copy_(x)),
                                           refused(lambda: nn.Sequential(nn.Linear(3, 2))(x)),  # all on the host
                                           refused(lambda: ctc(*CTC)), refused(lambda: nn.CTCLoss()(*CTC)),
                                           refused(lambda: xc.tensor_split(torch.tensor([1, 3])))]
print(json.dumps(out))
'''
MIXED = "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"
EXPECTED = {
    "cuda() leaves the source on the host": ["cpu", "cuda", False, True],
    "user code sees the GPU": ["cuda:0", True, 0, "cpu"],
    "marks follow ops": "cuda",
    "cpu() comes back to the host": ["cpu", "cuda"],
    "factory device=": ["cuda", "cuda", "cuda", "cpu"],
    "to() forms": ["cuda", "cuda", "cuda", "cpu", "cpu"],
    "Tensor.type forms": ["cuda", "cuda", "cpu", "cuda", "torch.cuda.FloatTensor", "torch.FloatTensor", True],
    "with torch.device": ["cuda", "cpu"],
    "module params and grads": ["cuda"] * 4,
    "nn.Parameter": "cuda",
    # torch's own code reads a GPU tensor's device as the CPU, but what it puts there is on the GPU
    "what torch puts on a GPU tensor's device": ["cuda", "cuda", "cuda", "cpu", "cuda:0"],
    # Module.to parses its arguments first: the device asked for by keyword must reach each move
    "Module.to with device=": ["cuda"] * 11,
    "marks stay out of pickles": False,
    "pin_memory": [True, False, True],
    "pinning a GPU tensor": "cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors can be pinned",
    "torch.cuda to the user": [True, 1, 0, [8, 0]],
    "torch.cuda to torch itself": True,  # "definitely not available": torch keeps its CPU paths
    "Event.elapsed_time": True,
    # a torch.Stream, as torch.cuda.Stream is: torch's functions that take a stream accept it
    "streams": [True, "cuda:0", False, True, "cuda"],
    "autocast(cuda)": "torch.float16",  # the GPU's default autocast dtype, on CPU autocast
    "GradScaler(cuda)": "cpu",
    "set_default_device(cuda)": ["cuda:0", "cuda", "cuda:0"],
    "Generator(device=cuda)": ["cuda:0", True, True, "cuda", "cuda", "cuda"],
    "a CUDA generator draws the CPU's numbers": True,
    # seeding helpers index the device's default generator; torch.cuda.manual_seed seeds it too
    "torch.cuda.default_generators": [1, "cuda:0", 11, 11, "cuda"],
    # what a GPU raises (pytorch's check_generator), and so what the rehearsal raises
    "a generator of the other device": ["Expected a 'cpu' device type for generator but found 'cuda'",
                                        "Expected a 'cuda' device type for generator but found 'cpu'",
                                        "Expected a 'cpu' device type for generator but found 'cuda'"],
    "shuffling under set_default_device(cuda)": ["Expected a 'cuda' device type for generator but found 'cpu'",
                                                 "no error"],
    # the commonest GPU crash (a model on the GPU, its labels left on the host) fails here as there
    "mixing GPU and host tensors": [MIXED] * 7 + ["can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() "
                                                  "to copy the tensor to host memory first."],
    "what a GPU allows across devices": ["no error"] * 8,
}


@pytest.fixture(scope="session")
def semantics(tmp_path_factory):
    def make(d: Path) -> Audit:
        program = SEMANTICS.replace("ACCELERATOR\n", ACCELERATOR_ANSWERS, 1)
        p = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=EXAMPLES.parent)
        return Audit(p.returncode, p.stdout, p.stderr, d)

    p = shared(tmp_path_factory, "rehearsal-semantics", make)
    assert p.returncode == 0, p.stderr
    assert len(ANNOUNCE.findall(p.stderr)) == 1
    return json.loads(p.stdout)


@pytest.mark.parametrize("case", EXPECTED)
def test_rehearsal_semantics(semantics, case):
    assert semantics[case] == EXPECTED[case]


SHUFFLE_ON_DEFAULT_CUDA = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.set_default_device("cuda")
loader = DataLoader(TensorDataset(torch.randn(512, 16)), batch_size=64, shuffle=True)
model = nn.Linear(16, 1)
batches = iter(loader)


def step(i):
    (xb,) = next(batches)
    model(xb).sum().backward()
"""


def gpu_crash(tmp_path, name: str, source: str) -> dict:
    """Audit a trainer that a GPU refuses in its first step: the run's ending, checked to be that."""
    (tmp_path / name).write_text(source)
    a = audit("run", f"{tmp_path / name}:step", "--steps", "3", "--no-profile", "--quiet",
              out=tmp_path / "out", env=QUIET_ENV)
    assert a.returncode == 3, a.stderr
    ending = a.evidence["ending"]
    assert (ending["status"], ending["step"], ending["exception"]) == ("raised", 0, "RuntimeError")
    return ending


def test_a_crash_only_a_gpu_has_happens_in_rehearsal_at_its_line(tmp_path):
    """Shuffling under set_default_device("cuda") with the sampler's CPU generator: a GPU refuses the
    CUDA randperm (a well-known crash at the first batch); the rehearsal must not let it pass."""
    ending = gpu_crash(tmp_path, "shuffle.py", SHUFFLE_ON_DEFAULT_CUDA)
    assert ending["message"].startswith("Expected a 'cuda' device type for generator but found 'cpu'")
    assert "torch.Generator(device='cuda')" in ending["message"]
    assert (Path(ending["where"]["file"]).name, ending["where"]["line"]) == ("shuffle.py", 13)


LABELS_ON_HOST = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

device = torch.device("cuda")
loader = DataLoader(TensorDataset(torch.randn(256, 16), torch.randint(0, 4, (256,))), batch_size=32)
model = nn.Linear(16, 4).to(device)
batches = iter(loader)


def step(i):
    x, y = next(batches)
    loss = nn.functional.cross_entropy(model(x.to(device)), y)  # y stays on the host
    loss.backward()
"""


def test_labels_left_on_the_host_fail_in_rehearsal_as_on_a_gpu(tmp_path):
    """The commonest GPU crash: the model and inputs on the GPU, the labels not. On the CPU both are
    host tensors and the step runs; the rehearsal refuses the mix at the user's line, as a GPU does."""
    ending = gpu_crash(tmp_path, "labels.py", LABELS_ON_HOST)
    assert ending["message"].startswith(MIXED) and "torch.cross_entropy" in ending["message"]
    line = LABELS_ON_HOST.splitlines().index("    loss = nn.functional.cross_entropy(model(x.to(device)), y)"
                                             "  # y stays on the host") + 1
    assert (Path(ending["where"]["file"]).name, ending["where"]["line"]) == ("labels.py", line)


PIN_ON_DEFAULT_CUDA = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.set_default_device("cuda")
loader = DataLoader(TensorDataset(torch.randn(512, 16), torch.randn(512, 1)), batch_size=64, pin_memory=True)
model = nn.Linear(16, 1)
batches = iter(loader)


def step(i):
    x, y = next(batches)
    (model(x) - y).pow(2).mean().backward()
"""


def test_pinning_a_dataset_made_on_the_gpu_fails_in_rehearsal_as_on_a_gpu(tmp_path):
    """pin_memory=True over a dataset made under set_default_device("cuda"): the DataLoader's pinning
    step calls `pin_memory()` on GPU tensors and a GPU refuses it at the first batch. A CPU-only torch
    skips that step (no accelerator); the rehearsal must run it and refuse, at the user's line."""
    ending = gpu_crash(tmp_path, "pin.py", PIN_ON_DEFAULT_CUDA)
    assert ending["message"] == "cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors can be pinned"
    line = PIN_ON_DEFAULT_CUDA.splitlines().index("    x, y = next(batches)") + 1
    assert (Path(ending["where"]["file"]).name, ending["where"]["line"]) == ("pin.py", line)


# The correct use of pin_memory=True (a host dataset, its batches copied to the GPU): a loop of
# every step of the pinned side-stream prefetcher's program (PREFETCHER), audited with it.
PIN_HOST_DATASET = """

device = torch.device("cuda")
host_loader = DataLoader(TensorDataset(torch.randn(512, 16), torch.randn(512, 1)), batch_size=64, pin_memory=True)
host_model = nn.Linear(16, 1).to(device)
prefetched_step = step


def step(i):
    prefetched_step(i)
    for xh, yh in host_loader:
        xh, yh = xh.to(device, non_blocking=True), yh.to(device, non_blocking=True)  # HOST COPIES
        (host_model(xh) - yh).pow(2).mean().backward()
"""


def test_pinning_a_host_dataset_still_runs_in_rehearsal(prefetched):
    """The correct use of pin_memory=True (host dataset, copies to the GPU) is not refused, and its
    batches still count as pinned."""
    a, _ = prefetched(True)
    assert a.returncode == 0, a.stderr
    assert a.evidence["ending"]["status"] != "raised"
    line = next(n for n, t in enumerate(a.source.splitlines(), 1) if "# HOST COPIES" in t)
    copies = tallies(a, m.H2D_COPY)
    assert {t["where"]["line"] for t in copies} >= {line}  # (and the prefetcher's, pinned too)
    assert all(t["data"]["pinned"] and t["data"]["non_blocking"] for t in copies)


MULTI_LINE_MOVES = """
import torch
from torch import nn

model = nn.Sequential(
    nn.Linear(600, 1),
).cuda()  # the first request for CUDA
data = [torch.randn(512, 600) for _ in range(2)]
copy_kwargs = {"device": "cuda", "non_blocking": False}


def step(i):
    batch = (data[i % 2]
             .to(**copy_kwargs))  # the copy
    model(batch).sum().backward()
"""


def test_rehearsal_names_the_line_of_the_cuda_call_in_a_multi_line_statement(tmp_path):
    """A `.cuda()` / `.to(...)` call whose statement spans lines is named at the line holding the
    call, not the statement's first line: in the rehearsal note (the receiver's first line was the
    AST call's line) and in the copy's finding (for `.to(**kwargs)` Python's own line for the
    running call is where the whole call expression starts)."""
    trainer = tmp_path / "moves.py"
    trainer.write_text(MULTI_LINE_MOVES)
    lines = MULTI_LINE_MOVES.splitlines()
    cuda_line = lines.index(").cuda()  # the first request for CUDA") + 1
    copy_line = lines.index("             .to(**copy_kwargs))  # the copy") + 1
    a = audit("run", f"{trainer}:step", "--steps", "4", "--no-profile", "--quiet", out=tmp_path / "out",
              env=QUIET_ENV)
    assert a.returncode == 0, a.stderr
    reason = f".cuda() at line {cuda_line} of moves.py"
    assert f"({reason})" in a.stderr
    assert any(f"({reason})" in n for n in a.findings_doc["environment"]["notes"])
    (f,) = a.rule("pageable-copy")
    assert [(loc["file"], loc["line"]) for loc in f["locations"]] == [(str(trainer), copy_line)]
    assert {t["where"]["line"] for t in tallies(a, m.H2D_COPY)} == {copy_line}
    assert {t["where"]["line"] for t in tallies(a, m.H2D_COPY, setup=True)} == {cuda_line, copy_line}


CHECKPOINTED = """
import os
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

device = "cuda"
torch.manual_seed(0)
stem = nn.Linear(16, 32).to(device)
blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.1))
                       for _ in range(3)).to(device)
head = nn.Linear(32, 4).to(device)
params = [*stem.parameters(), *blocks.parameters(), *head.parameters()]
opt = torch.optim.AdamW(params, lr=1e-2)
x, y = torch.randn(8, 16, device=device), torch.randint(0, 4, (8,), device=device)


def block(k, h):
    h = blocks[k](h)
    return h + torch.arange(h.shape[-1], device=device) / h.shape[-1]  # made on the GPU again in the recompute


def two_blocks(h):  # a checkpoint within a checkpoint
    return checkpoint(block, 1, block(0, h), use_reentrant=False)


def step(i):
    opt.zero_grad(set_to_none=True)
    h = checkpoint(two_blocks, stem(x), use_reentrant=False)
    h = checkpoint(block, 2, h, use_reentrant=True)
    nn.functional.cross_entropy(head(h), y).backward()
    opt.step()
    if i == 2:
        torch.save({"model": [p.detach() for p in params], "opt": opt.state_dict()}, os.environ["PARITY_OUT"])


if __name__ == "__main__":
    for i in range(3):
        step(i)
"""


# The trainers that must compute in rehearsal what their CPU versions compute, each saving its state
# at step 2 to $PARITY_OUT (a module of its own, as it is written), and how each CPU version is made.
# They run side by side in one program, audited once and run plainly once: each steps its own model,
# optimizer and data (none changes state another reads), and each test compares its own trainer's
# state. (Their steps interleave, so the dropout draws of one follow another's: the same order in
# both runs.)
def _parity_trainers() -> dict[str, tuple[str, tuple[str, str]]]:
    return {"ckpt": (CHECKPOINTED, ("cuda", "cpu")), "ckpt_hooks": (CHECKPOINTED_UNDER_HOOKS, ("cuda", "cpu")),
            "per_sample": (PER_SAMPLE_GRADS, ("cuda", "cpu")), "channels_last": (CHANNELS_LAST, ('"cuda"', '"cpu"'))}


SIDE_BY_SIDE = """
import os
{imports}

TRAINERS = {{{pairs}}}


def step(i):
    for name, trainer in TRAINERS.items():
        os.environ["PARITY_OUT"] = os.path.join(os.environ["PARITY_DIR"], name + ".pt")
        trainer.step(i)


if __name__ == "__main__":
    for i in range(3):
        step(i)
"""


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory):
    """The parity trainers audited for 3 steps (main.py:step, which steps each) in rehearsal, and
    their CPU versions (every "cuda" replaced by "cpu") run plainly meanwhile: the audit, and each
    trainer's two saved states by name."""
    root = tmp_path_factory.mktemp("side-by-side")
    trainers = _parity_trainers()
    main = SIDE_BY_SIDE.format(imports="\n".join(f"import {n}" for n in trainers),
                               pairs=", ".join(f"{n!r}: {n}" for n in trainers))
    for kind in ("rehearsed", "plain"):
        (root / kind).mkdir()
        (root / kind / "main.py").write_text(main)
        for name, (source, (gpu, cpu)) in trainers.items():
            (root / kind / f"{name}.py").write_text(source if kind == "rehearsed" else source.replace(gpu, cpu))
    plain = subprocess.Popen([sys.executable, str(root / "plain" / "main.py")], cwd=root / "plain",  # meanwhile
                             env={**QUIET_ENV, "PARITY_DIR": str(root / "plain"), "PATH": ""})
    a = audit("run", f"{root / 'rehearsed' / 'main.py'}:step", "--steps", "3", "--no-profile", "--quiet",
              out=root / "out", env={**QUIET_ENV, "PARITY_DIR": str(root / "rehearsed")})
    return a, plain.wait(timeout=600), root  # (four trainers: more time than one had)


def assert_rehearsal_computes_as_the_cpu_version(side_by_side, name: str) -> None:
    """The trainer `name` (of _parity_trainers) ran to the end in rehearsal, and left the weights
    and optimizer state of its CPU version run plainly."""
    a, plain_returncode, root = side_by_side
    assert plain_returncode == 0
    assert a.returncode == 0, a.evidence["ending"]
    assert a.findings_doc["environment"]["rehearsal"] is True and len(a.evidence["steps"]) == 3
    want = _flat(torch.load(root / "plain" / f"{name}.pt", weights_only=True))
    got = _flat(torch.load(root / "rehearsed" / f"{name}.pt", weights_only=True))
    assert want.keys() == got.keys() and any(k.startswith("opt.state.") for k in want)
    assert_same_state(want, got)


def test_activation_checkpointing_runs_in_rehearsal_as_on_the_cpu(side_by_side):
    """checkpoint() re-runs the block in backward, where the rehearsal mode is off torch's stack
    (backward starts inside a torch call): the recompute must be rehearsed as its forward was, in
    both variants and nested, with no false device mix, and compute what the CPU version computes
    (dropout included: the recompute replays the forward's RNG state)."""
    assert_rehearsal_computes_as_the_cpu_version(side_by_side, "ckpt")


CHECKPOINTED_UNDER_HOOKS = """
import os
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

device = "cuda"
torch.manual_seed(0)
stem = nn.Linear(16, 32).to(device)
blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.1))
                       for _ in range(2)).to(device)
head = nn.Linear(32, 4).to(device)
params = [*stem.parameters(), *blocks.parameters(), *head.parameters()]
opt = torch.optim.AdamW(params, lr=1e-2)
x, y = torch.randn(8, 16, device=device), torch.randint(0, 4, (8,), device=device)


def offload(t):  # the program's own saved-tensor hooks: activations wait in host memory
    return t.device, t.cpu()


def reload(packed):
    where, t = packed
    return t.to(where)


def step(i):
    opt.zero_grad(set_to_none=True)
    with torch.autograd.graph.save_on_cpu():
        h = checkpoint(blocks[0], stem(x), use_reentrant=True)
    with torch.autograd.graph.saved_tensors_hooks(offload, reload):
        h = checkpoint(blocks[1], h, use_reentrant=True)
        loss = nn.functional.cross_entropy(head(h), y)
    loss.backward()
    opt.step()
    if i == 2:
        torch.save({"model": [p.detach() for p in params], "opt": opt.state_dict()}, os.environ["PARITY_OUT"])


if __name__ == "__main__":
    for i in range(3):
        step(i)
"""


def test_reentrant_checkpointing_under_saved_tensor_hooks_runs_in_rehearsal(side_by_side):
    """The reentrant checkpoint keeps its inputs as saved tensors: under saved-tensor hooks
    (save_on_cpu, the program's own pack/unpack) autograd hands them back to its backward as new
    tensor objects, without the rehearsal's mark, and the recompute's first GPU layer then "got a
    CPU tensor" (a false device mix, exit 3). Valid on a GPU: it must run, and compute what the CPU
    version computes."""
    assert_rehearsal_computes_as_the_cpu_version(side_by_side, "ckpt_hooks")


HOST_INTO_CHECKPOINT = """
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

model = nn.Linear(16, 16).to("cuda")
head = nn.Linear(16, 16).to("cuda")
x = torch.randn(4, 16, device="cuda", requires_grad=True)
extra = torch.randn(4, 16)  # left on the host


def block(h, e):
    return model(h) + head(e)


def step(i):
    checkpoint(block, x, extra, use_reentrant=REENTRANT).sum().backward()
"""


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_host_tensor_in_a_checkpointed_block_still_fails(tmp_path, reentrant):
    """Rehearsing the recompute must not excuse real mixes: a GPU layer given a host tensor inside
    a checkpointed block fails at the user's line, as on a GPU."""
    source = HOST_INTO_CHECKPOINT.replace("REENTRANT", str(reentrant))
    ending = gpu_crash(tmp_path, "host_ckpt.py", source)
    assert ending["message"].startswith(MIXED) and "Linear (its weights are on the GPU)" in ending["message"]
    line = source.splitlines().index("    return model(h) + head(e)") + 1
    assert (Path(ending["where"]["file"]).name, ending["where"]["line"]) == ("host_ckpt.py", line)


PER_SAMPLE_GRADS = """
import os
import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
x, y = torch.randn(32, 8, device=device), torch.randint(0, 2, (32,), device=device)


def loss_one(p, xi, yi):
    return nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])


def step(i):
    params = {k: v.detach() for k, v in model.named_parameters()}
    per_sample = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in per_sample.values()]).norm(dim=0)
    factor = (1.0 / (norms + 1e-6)).clamp(max=1.0)  # DP-SGD: each sample's gradient clipped to norm 1
    slope = jacrev(lambda t: model(t).sum(-1))(x[0])  # the input gradient of one sample
    for k, p in model.named_parameters():
        p.grad = (per_sample[k] * factor.view(-1, *[1] * (p.dim()))).mean(0) + 1e-3 * slope.mean()
    opt.step()
    if i == 2:
        torch.save({"model": [p.detach() for p in model.parameters()], "opt": opt.state_dict()},
                   os.environ["PARITY_OUT"])


if __name__ == "__main__":
    for i in range(3):
        step(i)
"""


def test_torch_func_transforms_run_in_rehearsal_as_on_the_cpu(side_by_side):
    """vmap, grad and jacrev wrap their inputs in new tensors and unwrap their results in C++,
    where no torch function sees them: the per-sample gradients of GPU weights came back as host
    tensors and the first op mixing them with the GPU batch was refused as a device mix, at step 0
    (exit 3). A GPU runs this DP-SGD step; the rehearsal must too, and compute what the CPU
    version computes."""
    assert_rehearsal_computes_as_the_cpu_version(side_by_side, "per_sample")


HOST_INTO_VMAP = """
import torch
from torch.func import vmap

w = torch.randn(16, device="cuda")
x = torch.randn(8, 16)  # left on the host


def step(i):
    vmap(lambda xi: (xi * w).sum())(x)
"""


def test_a_host_tensor_inside_vmap_still_fails(tmp_path):
    """Marks passed through torch.func must not excuse real mixes: a host batch multiplied with a
    GPU tensor inside vmap fails at the user's line, as on a GPU."""
    ending = gpu_crash(tmp_path, "host_vmap.py", HOST_INTO_VMAP)
    assert ending["message"].startswith(MIXED) and "Tensor.mul" in ending["message"]
    assert (Path(ending["where"]["file"]).name, ending["where"]["line"]) == ("host_vmap.py", 10)


# --- what rehearsal finds ------------------------------------------------------------------------

def test_cuda_everywhere_syncs_and_pageable_copies(rehearsed):
    a = rehearsed("gpu_cuda_everywhere")
    env = a.findings_doc["environment"]
    assert env["rehearsal"] is True and env["device"] == "cpu" and env["cuda_available"] is False
    assert any(n.startswith("CUDA rehearsal") and "counted, not timed" in n for n in env["notes"])
    assert len(ANNOUNCE.findall(a.stderr)) == 1

    sync = located(a, "gpu_cuda_everywhere", "host-sync")
    assert sync["evidence"]["judged_as_gpu_code"] is True  # judged as GPU code, not "would sync on an accelerator"
    assert sync["severity"] == graded_severity(sync, a.findings_doc)
    # estimated on the default device row (A100 SXM4 80GB): 3 syncs a step x 10 us round trip
    assert sync["cost"]["measured"] is False and sync["cost"]["ms_per_step"] == pytest.approx(0.03)
    assert "A100 SXM4 80GB (the default" in sync["cost"]["note"] and "10 us" in sync["cost"]["note"]
    sites = {s["what"]: s for s in sync["evidence"]["sites"]}
    assert set(sites) == {"Tensor.item", "bool(Tensor)", "Tensor.cpu"}  # float(lr_scale) reads a host tensor
    assert all(s["count"] == STEPS for s in sites.values())

    copy = located(a, "gpu_cuda_everywhere", "pageable-copy")
    batch_bytes = 512 * 512 * 4 + 512 * 8  # float32 inputs and int64 labels of one batch
    assert copy["evidence"]["bytes_per_step"] == batch_bytes
    assert copy["evidence"]["copies_per_step"] == 2
    # 1.05 MB a step at the default row's 10 GB/s pageable PCIe Gen4 bandwidth: 0.105 ms
    assert copy["cost"]["measured"] is False and copy["cost"]["ms_per_step"] == pytest.approx(batch_bytes / 1e7, abs=1e-3)
    assert "10 GB/s from pageable memory" in copy["cost"]["note"] and "25 GB/s pinned" in copy["cost"]["note"]
    assert copy["cost"]["ms_per_step"] > sync["cost"]["ms_per_step"]  # ranked: the copies first
    assert copy["fix"]["config"]["DataLoader.pin_memory"] is True
    assert [d["pin_memory"] for d in copy["evidence"]["dataloaders"]] == [False]


def test_pageable_copy_threshold_on_real_evidence(rehearsed):
    """The probe half keeps to `min-mb-per-step`: the example moves 1.05 MB per step."""
    ev = m.decode((rehearsed("gpu_cuda_everywhere").out / "evidence.json").read_bytes())
    rule = all_rules()["pageable-copy"]()
    assert len(pageable_rehearsal_findings(rule, ev, rule.options_with({"min-mb-per-step": 1.0}))) == 1
    assert pageable_rehearsal_findings(rule, ev, rule.options_with({"min-mb-per-step": 1.1})) == []


def test_default_device_cuda_makes_batches_on_the_gpu(rehearsed):
    a = rehearsed("gpu_default_device")
    f = located(a, "gpu_default_device", "dataloader-on-device")
    assert f["evidence"]["device_batches"] == STEPS
    # 8 batches an epoch: step 8's first next() ends the epoch (StopIteration, no batch) and the
    # trainer starts another; the batches drawn are the STEPS returned, not the 11 calls
    assert f["evidence"]["batches"] == STEPS
    assert f"{STEPS} of {STEPS} batches came out of the DataLoader" in f["message"]
    assert f["evidence"]["default_device_lines"] == expected_lines(EXAMPLES / "gpu_default_device.py",
                                                                   "dataloader-on-device")[:1]
    assert f["evidence"]["batch_bytes_per_step"] == 256 * 128 * 4 + 256 * 8
    assert "pin_memory=True" in f["fix"]["summary"] and "non_blocking=True" in f["fix"]["summary"]
    # (judged as GPU code; a warning where its saving on the predicted GPU step is 0.5% or more)
    assert f["severity"] == graded_severity(f, a.findings_doc)
    assert gpu_warnings(a) == ({"dataloader-on-device"} if f["severity"] == "warning" else set())


FRACTIONAL_RATES = """
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.set_default_device("cuda")
loader = DataLoader(TensorDataset(torch.randn(48, 8), torch.randint(0, 2, (48,))), batch_size=16)
model = nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
extra = torch.randn(2048, 256, device="cpu")  # 2.1 MB, unpinned
batches = iter(loader)


def next_batch():
    global batches
    try:
        return next(batches)
    except StopIteration:
        batches = iter(loader)  # a new epoch: its iterator draws a seed, a tensor on the default device
        return next(batches)


def step(i):
    x, y = next_batch()
    if i % 3:
        extra.to("cuda", non_blocking=True)  # 4 of 7 steps
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
"""


def test_rates_per_step_are_said_to_three_significant_digits(tmp_path):
    """7 steps: 2 new epochs (2/7 GPU tensors per step made while batching) and 4 pageable copies
    (4/7 per step): said as 0.286 and 0.571, not 0.285714 and 0.571429."""
    trainer = tmp_path / "rates.py"
    trainer.write_text(FRACTIONAL_RATES)
    a = audit("run", f"{trainer}:step", "--steps", "7", "--no-profile", "--no-numerics", "--quiet",
              out=tmp_path / "out", env=QUIET_ENV)
    assert a.returncode == 0, a.stderr
    [loader] = a.rule("dataloader-on-device")
    assert "7 of 7 batches" in loader["message"]
    assert "0.286 GPU tensors per step were created while making batches" in loader["message"]
    assert "x0.286/step at line 20" in loader["message"]
    [copy] = a.rule("pageable-copy")
    assert "0.571 host-to-device copies per step" in copy["message"]
    assert "x0.571/step (1.20 MB) at line 27" in copy["message"]
    assert "; 0.571 per step ask for non_blocking=True" in copy["message"]
    assert not re.search(r"\d\.\d{4}", loader["message"] + copy["message"])


PLATEAU = """
import torch
from torch import nn

torch.manual_seed(0)
x, y = torch.randn(64, 16, device="cuda"), torch.randn(64, 1, device="cuda")
models = [nn.Linear(16, 1).to("cuda") for _ in range(2)]
opts = [torch.optim.SGD(model.parameters(), lr=0.01) for model in models]
plateaus = [torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=2) for opt in opts]


def step(i):
    losses = [nn.functional.mse_loss(model(x), y) for model in models]
    for opt, loss in zip(opts, losses):
        opt.zero_grad()
        loss.backward()
        opt.step()
    plateaus[0].step(losses[0].detach())  # EVERY STEP
    if i % 4 == 0:
        plateaus[1].step(losses[1].detach())  # PER EPOCH
"""


@pytest.fixture(scope="module")
def plateau(tmp_path_factory):
    """PLATEAU audited for 8 steps: one scheduler stepped every step, one once per "epoch" (1 in 4),
    each at its own line."""
    trainer = tmp_path_factory.mktemp("plateau") / "plateau.py"
    trainer.write_text(PLATEAU)
    return audit("run", f"{trainer}:step", "--steps", "8", "--no-profile", "--no-numerics", "--quiet",
                 out=trainer.parent / "out", env=QUIET_ENV), trainer


@pytest.mark.parametrize("mark,syncs", [("EVERY STEP", 1.0), ("PER EPOCH", None)], ids=["every-step", "per-epoch"])
def test_reduce_lr_on_plateau_of_a_gpu_tensor_is_a_sync(plateau, mark, syncs):
    """ReduceLROnPlateau.step(metric) reads its metric with float(): given the GPU loss each step,
    torch fetches it from the device at every call, at the user's line (it was not counted: the
    float() is torch's own code). Stepped once per "epoch" (1 step in 4), it stays below
    host-sync's min-share-of-steps and is not reported (its syncs counted, at its line)."""
    a, trainer = plateau
    assert a.returncode == 0, a.stderr
    line = next(n for n, t in enumerate(PLATEAU.splitlines(), 1) if f"# {mark}" in t)
    [f] = a.rule("host-sync")  # the every-step scheduler's
    if syncs is None:
        counted = [t for t in tallies(a, m.SYNC) if t["where"]["line"] == line]
        assert {t["what"] for t in counted} == {"ReduceLROnPlateau.step"} and len(counted) == 2  # steps 0 and 4
        assert all(s["line"] != line for s in f["evidence"]["sites"]), f["evidence"]["sites"]
        return
    assert f["severity"] == graded_severity(f, a.findings_doc) and f["evidence"]["syncs_per_step"] == syncs
    [site] = f["evidence"]["sites"]
    assert (site["what"], site["file"], site["line"], site["per_step"]) == ("ReduceLROnPlateau.step", str(trainer),
                                                                             line, syncs)
    assert "once per epoch" in f["fix"]["summary"] and "log_every_n_steps" not in f["fix"]["config"]


EVENT_TIMED = """
import torch
from torch import nn

model = nn.Linear(32, 32).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
times = []


def step(i):
    start.record()
    model(torch.randn(16, 32, device="cuda")).sum().backward()
    opt.step()
    end.record()
    torch.cuda.synchronize()  # SYNC LINE
    READ
"""


@pytest.mark.parametrize("read", ["times.append(start.elapsed_time(end))  # READ LINE", "pass"],
                         ids=["event-timing", "plain-sync"])
def test_synchronize_for_event_timing_is_advised_as_timing(tmp_path, read):
    """`torch.cuda.synchronize()` right before `start.elapsed_time(end)`: removing it, as host-sync
    advised ("profilers sync for you"), would make elapsed_time fail on a GPU. The sync is there for
    the events: the advice is to read them every N steps (they keep their timestamps), and the site
    names the elapsed_time line. A synchronize() that no elapsed_time reads keeps the old advice."""
    source = EVENT_TIMED.replace("READ", read)
    trainer = tmp_path / "timed.py"
    trainer.write_text(source)
    a = audit("run", f"{trainer}:step", "--steps", "6", "--no-profile", "--no-numerics", "--quiet",
              out=tmp_path / "out", env=QUIET_ENV)
    assert a.returncode == 0, a.stderr
    [f] = a.rule("host-sync")
    lines = source.splitlines()
    sync_line = next(n for n, t in enumerate(lines, 1) if "SYNC LINE" in t)
    [site] = f["evidence"]["sites"]
    assert (site["what"], site["line"], site["count"]) == ("torch.cuda.synchronize", sync_line, 6)
    if read == "pass":
        assert "before_elapsed_time" not in site and "elapsed_time" not in f["message"] + f["fix"]["summary"]
        assert "remove explicit synchronize() calls" in f["fix"]["summary"]
        return
    read_line = next(n for n, t in enumerate(lines, 1) if "READ LINE" in t)
    assert site["before_elapsed_time"] == read_line
    assert (f"torch.cuda.synchronize x1/step at line {sync_line} (before Event.elapsed_time at line {read_line})"
            in f["message"]), f["message"]
    assert "remove explicit synchronize()" not in f["fix"]["summary"]
    assert "call `end.synchronize()` and `start.elapsed_time(end)` only at logging steps" in f["fix"]["summary"]


def test_cuda_in_getitem_is_found_at_its_line(rehearsed):
    a = rehearsed("gpu_dataset_cuda")
    f = located(a, "gpu_dataset_cuda", "dataloader-on-device")
    ops = {(o["what"], o["line"]): o["count"] for o in f["evidence"]["ops"]}
    assert ops == {("Tensor.cuda", 20): 2 * 128 * STEPS}  # inputs and labels of every sample
    assert f["evidence"]["device_batches"] == STEPS
    assert not tallies(a, m.H2D_COPY)  # copies made while loading are the loader's, not pageable-copy's


def test_per_step_peak_stats_reset(rehearsed):
    a = rehearsed("gpu_peak_stats")
    f = located(a, "gpu_peak_stats", "peak-stats-reset")
    assert f["evidence"]["calls"] == STEPS and f["evidence"]["steps_with_reset"] == STEPS
    standins = {}
    for t in tallies(a, m.CUDA_STANDIN):
        standins[t["what"]] = standins.get(t["what"], 0) + t["count"]
    assert standins["torch.cuda.reset_peak_memory_stats"] == STEPS
    assert standins["torch.cuda.max_memory_allocated"] == STEPS
    copies = tallies(a, m.H2D_COPY)  # pin_memory=True: remembered although a CPU cannot pin
    assert copies and all(t["data"]["pinned"] and t["data"]["non_blocking"] for t in copies)
    # (judged as GPU code; a warning where its saving on the predicted GPU step is 0.5% or more)
    assert f["severity"] == graded_severity(f, a.findings_doc)
    assert gpu_warnings(a) == ({"peak-stats-reset"} if f["severity"] == "warning" else set())


def test_fp16_autocast_and_grad_scaler(rehearsed):
    a = rehearsed("gpu_amp")
    f = located(a, "gpu_amp", "host-sync")
    # the loss logged every step, and GradScaler.step's own found_inf read (AdamW is not fused)
    assert sorted(s["what"] for s in f["evidence"]["sites"]) == ["GradScaler.step", "Tensor.item"]
    assert f["fix"]["config"] == {"log_every_n_steps": 50, "optimizer": {"fused": True}}
    setup = {t["what"] for t in tallies(a, m.CUDA_STANDIN, setup=True)}
    assert {"torch.amp.GradScaler(cuda)", "torch.autocast(cuda)"} <= setup
    assert gpu_warnings(a) == {"host-sync"}


def test_clean_gpu_trainer_is_silent(rehearsed):
    a = rehearsed("gpu_clean")
    assert a.returncode == 0, a.stderr
    assert a.findings_doc["environment"]["rehearsal"] is True
    assert [f for f in a.findings if f["severity"] != "info"] == []
    # it did copy every batch to the "GPU", pinned and non-blocking, and read the loss every 10 steps
    assert sum(t["count"] for t in tallies(a, m.H2D_COPY)) == 2 * STEPS
    assert sum(t["count"] for t in tallies(a, m.SYNC)) == STEPS // 10


# --- the rehearsal against the H100 audits of the same examples ----------------------------------

# `audit run examples/NAME.py:step --steps 30` on an H100 80GB (tests/fixtures/README.md)
H100_AUDITS = FIXTURES / "h100" / "audited-examples"
# What the rehearsal and the GPU must agree on: the rules judged as GPU code, at the same lines of
# the example (each line the example marks for the rule).
SHARED = {
    "gpu_amp": {"host-sync": [39, 41]},
    "gpu_cuda_everywhere": {"host-sync": [38, 42, 43]},
    "gpu_peak_stats": {"peak-stats-reset": [30]},
    "gpu_clean": {},
    "gpu_dataset_cuda": {},
    "gpu_default_device": {},
}
# The differences that are expected, each named (the rules read from the timings each machine took,
# dataloader-bound and step-slowdown, are not compared):
# - pageable-copy in gpu_cuda_everywhere: the rehearsal counts the setup's copy (line 14) beside the
#   step's (line 34); the H100 audit reads copies from its profiled steps only;
# - dataloader-on-device: the H100 audit reads it from the trace, which names the functions doing it
#   by their def lines; the rehearsal names the lines the example marks;
# - amp-opportunity: the rehearsal counts the fp32 matmul FLOPs (info); on the GPU it needs 1 ms a step
#   of fp32 matmul kernels (min-ms-per-step), more than these small models' whole GPU work;
# - gpu-idle and launch-bound read a GPU's kernel timeline: the H100 audit's alone here.
GPU_ONLY = {"gpu-idle", "launch-bound"}


def example_lines(findings: list[dict], name: str) -> dict[str, list[int]]:
    """rule -> the lines of examples/NAME.py its finding names (the H100's paths may start at /src/)."""
    return {f["rule"]: sorted({loc["line"] for loc in f["locations"] if Path(loc["file"]).name == f"{name}.py"})
            for f in findings}


@pytest.mark.parametrize("name", list(SHARED))
def test_the_rehearsal_finds_what_the_h100_found(rehearsed, name):
    a = rehearsed(name)
    assert a.returncode == 0, a.stderr
    here = example_lines(a.findings, name)
    gpu = example_lines(json.loads((H100_AUDITS / f"ex_{name}" / "findings.json").read_text())["findings"], name)
    source = (EXAMPLES / f"{name}.py").read_text().splitlines()
    for rule, lines in SHARED[name].items():
        assert here.get(rule) == gpu.get(rule) == lines == expected_lines(EXAMPLES / f"{name}.py", rule), rule
    judged = (set(here) | set(gpu)) & JUDGED_AS_GPU
    for rule in judged - set(SHARED[name]):
        if rule == "pageable-copy":
            assert name == "gpu_cuda_everywhere" and (here[rule], gpu[rule]) == ([14, 34], [34])
        else:
            assert rule == "dataloader-on-device", (rule, here.get(rule), gpu.get(rule))
            assert gpu[rule] and all(source[n - 1].lstrip().startswith("def ") for n in gpu[rule]), gpu[rule]
            assert set(expected_lines(EXAMPLES / f"{name}.py", rule)) <= set(here[rule]), here[rule]
    assert "amp-opportunity" not in gpu
    assert all(f["severity"] == "info" for f in a.rule("amp-opportunity"))
    assert not set(here) & GPU_ONLY


# --- what rehearsal computes ---------------------------------------------------------------------

def assert_same_state(want: dict, got: dict) -> None:
    """Two flattened states (see _flat) equal entry by entry: tensors bit for bit."""
    for k in want:
        if isinstance(want[k], torch.Tensor):
            assert torch.equal(want[k], got[k]), k
        else:
            assert want[k] == got[k], k


def _flat(state: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif isinstance(v, list):
            out.update(_flat(dict(enumerate(v)), f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# The CPU versions of the PARITY examples run plainly, one after another in one process, each as
# WRAPPER runs it: each example seeds torch as it is imported, and sets no state the next one reads
# (gpu_default_device's CPU version sets the default device to the CPU, the default already).
PLAIN_PARITY = """
import sys
sys.path.insert(0, {examples!r})
import importlib
import torch

for name in {names!r}:
    trainer = importlib.import_module(name)
    for i in range({steps}):
        trainer.step(i)
    torch.save({{"model": trainer.model.state_dict(), "opt": trainer.opt.state_dict()}}, name + ".pt")
"""


@pytest.fixture(scope="module")
def plain_parity(tmp_path_factory) -> Path:
    """The folder where the CPU versions of the PARITY examples (every "cuda" replaced by "cpu"),
    run plainly for STEPS steps, left their trained states (NAME.pt)."""
    root = tmp_path_factory.mktemp("plain-parity")
    for name in PARITY:
        (root / f"{name}.py").write_text((EXAMPLES / f"{name}.py").read_text().replace("cuda", "cpu"))
    runner = root / "plain_parity.py"
    runner.write_text(PLAIN_PARITY.format(examples=str(root), names=PARITY, steps=STEPS))
    subprocess.run([sys.executable, str(runner)], check=True, capture_output=True, cwd=root,
                   env={**QUIET_ENV, "PATH": ""})
    return root


@pytest.mark.parametrize("name", PARITY)
def test_rehearsal_computes_what_the_cpu_version_computes(rehearsed, plain_parity, name):
    """The same trainer with every "cuda" replaced by "cpu", run plainly, ends with equal weights
    and optimizer state."""
    a = rehearsed(name)
    assert a.returncode == 0, a.stderr
    assert a.findings_doc["environment"]["rehearsal"] is True
    assert "(--rehearse)" in a.stderr  # forced: the wrapper itself does not ask for CUDA
    want = _flat(torch.load(plain_parity / f"{name}.pt", weights_only=True))
    got = _flat(torch.load(a.out.parent / "state.pt", weights_only=True))  # and no rehearsal marks pickled
    assert want.keys() == got.keys()
    assert any(k.startswith("opt.state.") for k in want)  # the optimizer stepped: there is state to compare
    assert_same_state(want, got)


CUDA_FP16_NO_SCALER = '''
import torch
from torch import nn

device = "cuda"
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(32, 64, device=device), torch.randint(0, 10, (32,), device=device)


def step(i):
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
'''


def test_amp_unscaled_fix_names_the_programs_device_in_rehearsal(tmp_path):
    """Rehearsed CUDA float16 autocast runs as CPU autocast, but the fix is for the program: CUDA."""
    trainer = tmp_path / "fp16_cuda.py"
    trainer.write_text(CUDA_FP16_NO_SCALER)
    a = audit("run", f"{trainer}:step", "--steps", "4", "--rehearse", "--no-profile", "--quiet",
              out=tmp_path / "out", env=QUIET_ENV)
    assert a.returncode == 0, a.stderr
    assert a.findings_doc["environment"]["rehearsal"] is True
    (f,) = a.rule("amp-unscaled")
    assert f["fix"]["config"]["GradScaler"] == 'torch.amp.GradScaler("cuda")'
    assert f["locations"][0]["file"] == str(trainer) and f["locations"][0]["line"] == 14


CHANNELS_LAST = '''
import os
import torch
import torch.nn.functional as F
from torch import nn

device = torch.device("cuda")
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                      nn.Flatten(), nn.Linear(8, 4))
model = model.to(device=device, memory_format=torch.channels_last)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
x = torch.randn(16, 3, 8, 8).to(device=device, memory_format=torch.channels_last)
y = torch.randint(0, 4, (16,), device=device)


def step(i):
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    if i == 2 and "PARITY_OUT" in os.environ:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, os.environ["PARITY_OUT"])


if __name__ == "__main__":
    for i in range(3):
        step(i)
'''


def test_a_model_moved_with_device_by_keyword_trains_as_its_cpu_version(side_by_side):
    """`model.to(device=device, memory_format=torch.channels_last)`: Module.to parses its arguments
    with a torch function, which the rehearsal rewrote to the CPU, so no parameter was marked and
    the first forward died of a device mix (Conv2d's inputs on the GPU, its weights not)."""
    assert_rehearsal_computes_as_the_cpu_version(side_by_side, "channels_last")


PREFETCHER = '''
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Prefetcher:
    """The next batch is copied on a side stream while the current one trains (apex's data_prefetcher)."""

    def __init__(self, loader):
        self.loader, self.it, self.stream = loader, iter(loader), torch.cuda.Stream()
        self.preload()

    def preload(self):
        x, y = next(self.it)
        with torch.cuda.stream(self.stream):
            self.x = x.cuda(non_blocking=True)
            self.y = y.cuda(non_blocking=True)

    def next(self):
        torch.cuda.current_stream().wait_stream(self.stream)
        x, y = self.x, self.y
        x.record_stream(torch.cuda.current_stream())
        y.record_stream(torch.cuda.current_stream())
        self.preload()
        return x, y


torch.manual_seed(0)
data = TensorDataset(torch.randn(640, 3, 32, 32), torch.randint(0, 10, (640,)))
loader = DataLoader(data, batch_size=128, PIN)
model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=4), nn.ReLU(), nn.Flatten(), nn.Linear(512, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
batches = Prefetcher(loader)


def step(i):
    x, y = batches.next()
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()
'''


@pytest.fixture(scope="module")
def prefetched(tmp_path_factory):
    """PREFETCHER audited for 4 steps, from an unpinned or a pinned loader (the pinned one with
    PIN_HOST_DATASET's loop in each step): (the audit, with its program's text as `.source`; the file)."""
    done = {}

    def get(pinned: bool):
        if pinned not in done:
            source = PREFETCHER.replace("PIN", f"pin_memory={pinned}") + (PIN_HOST_DATASET if pinned else "")
            trainer = tmp_path_factory.mktemp("prefetch") / "prefetch.py"
            trainer.write_text(source)
            a = audit("run", f"{trainer}:step", "--steps", "4", "--no-profile", "--quiet", out=trainer.parent / "out",
                      env=QUIET_ENV)
            a.source = source  # type: ignore[attr-defined]
            done[pinned] = a, trainer
        return done[pinned]

    return get


@pytest.mark.parametrize("pinned", [False, True])
def test_a_side_stream_prefetcher_runs_and_its_unpinned_copies_are_found(prefetched, pinned):
    """`tensor.record_stream(torch.cuda.current_stream())` (the prefetcher of NVIDIA's ImageNet
    examples) died at its first call: the rehearsal's stream was not a torch.Stream, and torch's
    argument check refused it ('unknown parameter type'). The copies on the side stream are the
    program's copies: from an unpinned loader, pageable-copy names them (1.57 MB of images per step)."""
    a, _ = prefetched(pinned)
    assert a.returncode == 0, a.evidence["ending"]
    assert a.evidence["ending"]["status"] == "completed" and len(a.evidence["steps"]) == 4
    if pinned:
        assert gpu_warnings(a) == set()
        return
    (f,) = a.rule("pageable-copy")
    lines = PREFETCHER.splitlines()
    sites = {s["line"]: s for s in f["evidence"]["sites"]}
    assert set(sites) == {lines.index("            self.x = x.cuda(non_blocking=True)") + 1,
                          lines.index("            self.y = y.cuda(non_blocking=True)") + 1}
    assert f["evidence"]["bytes_per_step"] == 128 * 3 * 32 * 32 * 4 + 128 * 8
    assert f["evidence"]["non_blocking_ignored"] == f["evidence"]["copies"]


@pytest.mark.parametrize("case", ["no pin_memory", "pin_memory from a config"])
def test_pageable_copy_prints_small_sizes_and_patches_the_loader(tmp_path, case):
    """The labels' copy printed as "(0.00 MB)" beside the images' megabytes, and the fix had no
    patch although the unpinned DataLoader call is in the user's file: now sizes below 0.01 MB
    print in KB or bytes, and fixes.patch adds pin_memory=True to the call (pinning leaves the
    batches' values alone), unless the call reads pin_memory from an expression: that is left to
    the user's config, and the fix says where."""
    computed = case == "pin_memory from a config"
    source = PREFETCHER.replace("step(i):\n    x, y = batches.next()", "step(i):\n    x, y = batches.next()\n    y = y.long()")
    if computed:  # uint8 labels: 128 bytes a batch
        source = (source.replace("torch.randint(0, 10, (640,))", "torch.randint(0, 10, (640,), dtype=torch.uint8)")
                  .replace("loader = DataLoader", "cfg = {'pin': False}\nloader = DataLoader")
                  .replace("PIN", "pin_memory=cfg['pin']"))
    else:
        source = source.replace(", PIN)", ")")
    trainer = tmp_path / "prefetch.py"
    trainer.write_text(source)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)  # the patch's paths are the repo's
    # (the loader waits ~1.5 ms a step here, under dataloader-bound's 2 ms; on a loaded machine it
    # passed it, and that rule's edit of the same DataLoader call, which carries pin_memory too, is
    # then taken in fixes.patch instead: the test is of pageable-copy alone)
    a = audit("run", f"{trainer}:step", "--steps", "4", "--no-profile", "--quiet", "--ignore", "dataloader-bound",
              out=tmp_path / "out", env=QUIET_ENV)
    assert a.returncode == 0, a.evidence["ending"]
    (f,) = a.rule("pageable-copy")
    lines = source.splitlines()
    y_line = lines.index("            self.y = y.cuda(non_blocking=True)") + 1
    loader_line = next(i for i, ln in enumerate(lines, 1) if ln.startswith("loader = DataLoader"))
    label_bytes = 128 if computed else 128 * 8
    assert {s["line"]: s["bytes"] // 4 for s in f["evidence"]["sites"]}[y_line] == label_bytes
    size = "128 bytes" if computed else "1.0 KB"
    assert f"Tensor.cuda x1/step ({size}) at line {y_line}" in f["message"]
    assert "0.00 MB" not in f["message"]
    assert f"Tensor.cuda x1/step (1.57 MB) at line {y_line - 1}" in f["message"]
    patch = patch_text(a.out / "fixes.patch")
    if computed:
        assert f["fix"]["edits"] == [] and "prefetch.py" not in patch
        assert f"line {loader_line} takes pin_memory from `cfg['pin']`: set it to True there" in f["fix"]["summary"]
        return
    assert [e["start"] for e in f["fix"]["edits"]] == [loader_line]
    assert "-loader = DataLoader(data, batch_size=128)\n+loader = DataLoader(data, batch_size=128, pin_memory=True)\n" in patch
    assert "[changes results" not in patch
    subprocess.run(["git", "apply", str(a.out / "fixes.patch")], cwd=tmp_path, check=True)
    assert trainer.read_text().splitlines()[loader_line - 1] == "loader = DataLoader(data, batch_size=128, pin_memory=True)"


MEMORY_HISTORY = '''
import os
import pickle
import torch
from torch import nn

torch.cuda.memory._record_memory_history(max_entries=100000)
model = nn.Linear(16, 4).to("cuda")
x = torch.randn(8, 16, device="cuda")
seen = []


def step(i):
    model(x).sum().backward()
    if i == 1:
        torch.cuda.memory._dump_snapshot(os.environ["SNAPSHOT"])
        with open(os.environ["SNAPSHOT"], "rb") as f:
            seen.append(len(pickle.load(f)["segments"]))
        seen.append(len(torch.cuda.memory._snapshot()["device_traces"]))
        torch.cuda.memory._record_memory_history(enabled=None)
'''


def test_memory_history_calls_run_on_the_rehearsed_requests(tmp_path):
    """`torch.cuda.memory._record_memory_history(...)` (how PyTorch's docs have a program record its
    allocations for a snapshot) raised AttributeError ('torch._C' has no attribute
    '_cuda_record_memory_history') at import: the run ended before its first step. They are answered
    from the requests the program's GPU tensors make (the dump writes the snapshot the simulated
    allocator would have: auditor.capture.rehearsal.memory) and recorded at their lines."""
    trainer = tmp_path / "history.py"
    trainer.write_text(MEMORY_HISTORY)
    a = audit("run", f"{trainer}:step", "--steps", "3", "--no-profile", "--quiet", out=tmp_path / "out",
              env={**QUIET_ENV, "SNAPSHOT": str(tmp_path / "snap.pickle")})
    assert a.returncode == 0, a.evidence["ending"]
    assert a.evidence["ending"]["status"] == "completed" and len(a.evidence["steps"]) == 3
    with open(tmp_path / "snap.pickle", "rb") as f:
        snap = pickle.load(f)
    # the Linear's weight and bias and x, each a small-pool block of one 2 MiB segment
    assert [s["total_size"] for s in snap["segments"]] == [2 << 20]
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    assert {e["size"] for e in allocs[:3]} == {16 * 4 * 4, 4 * 4, 8 * 16 * 4}
    lines = MEMORY_HISTORY.splitlines()
    got = {(t["what"], t["where"]["line"]) for t in tallies(a, "cuda-standin", setup=True)}
    assert {("torch.cuda.memory._record_memory_history", lines.index(line) + 1) for line in (
        "torch.cuda.memory._record_memory_history(max_entries=100000)",
        "        torch.cuda.memory._record_memory_history(enabled=None)")} <= got
    assert ("torch.cuda.memory._dump_snapshot",
            lines.index('        torch.cuda.memory._dump_snapshot(os.environ["SNAPSHOT"])') + 1) in got


GRAD_NORM_LOG = '''
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(16, 32).cuda(), torch.randint(0, 4, (16,)).cuda()
norms = []


def step(i):
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    norms.append(grad_norm.item())
'''


def test_logging_the_clipped_gradient_norm_is_a_sync(tmp_path):
    """clip_grad_norm_ returns the norm on the gradients' device: on a GPU, logging it with .item()
    every step waits for the device. Its norm came back a host tensor in rehearsal (torch's own
    `norm.to(grads[0].device)` read the CPU), and the sync went unreported."""
    trainer = tmp_path / "norms.py"
    trainer.write_text(GRAD_NORM_LOG)
    a = audit("run", f"{trainer}:step", "--steps", "4", "--no-profile", "--quiet", out=tmp_path / "out",
              env=QUIET_ENV)
    assert a.returncode == 0, a.evidence["ending"]
    (f,) = a.rule("host-sync")
    assert f["severity"] == "warning" and f["evidence"]["judged_as_gpu_code"] is True
    line = GRAD_NORM_LOG.splitlines().index("    norms.append(grad_norm.item())") + 1
    assert [(s["what"], s["line"], s["per_step"]) for s in f["evidence"]["sites"]] == [("Tensor.item", line, 1.0)]


COMPILED_CNN = '''
import os
import torch
import torch.nn.functional as F
from torch import nn

device = "cuda"
torch.manual_seed(0)
net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                    nn.Flatten(), nn.Linear(8, 4)).to(device, memory_format=torch.channels_last)
model = torch.compile(net)
opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
x = torch.randn(16, 3, 8, 8).to(device).contiguous(memory_format=torch.channels_last)
y = torch.randint(0, 4, (16,)).to(device)


def step(i):
    loss = F.cross_entropy(model(x), y)
    if not torch.isfinite(loss):
        return
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    if i == 2:
        from torch._dynamo.utils import counters
        torch.save({"net": net.state_dict(), "opt": opt.state_dict(),
                    "graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values())},
                   os.environ["PARITY_OUT"])


if __name__ == "__main__":
    for i in range(3):
        step(i)
'''


@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="inductor needs a C++ compiler")
def test_a_compiled_model_compiles_and_trains_as_its_cpu_version(tmp_path):
    """torch.compile runs in rehearsal: it tests values against torch.cuda's classes (StreamContext
    must stay a class) and asks torch.cuda about the device for its cache key (it must hear the
    truth: there is no CUDA, the tensors it compiles for are on the CPU). And it inlines a function
    mode on the stack into the graph it traces: the rehearsal's
    mode, which reads frames, broke the user's graph at every op (a UserWarning that dynamo 'does not
    know how to trace the builtin sys._getframe', from the auditor's file), and the pieces computed
    other weights than the CPU run's compiled model (0.001 apart after 30 steps of a small CNN).
    Traced, it now only rewrites devices and passes marks on: the same graphs, equal weights, and
    the output of the compiled model is a GPU tensor (`if not torch.isfinite(loss)` is a sync)."""
    trainer = tmp_path / "compiled_cnn.py"
    trainer.write_text(COMPILED_CNN)
    env = {**QUIET_ENV, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    a = audit("run", f"{trainer}:step", "--steps", "3", "--no-profile", "--quiet", out=tmp_path / "out",
              env={**env, "PARITY_OUT": str(tmp_path / "audited.pt")}, timeout=600)
    assert a.returncode == 0, a.evidence["ending"]
    assert a.findings_doc["environment"]["rehearsal"] is True
    assert "Dynamo" not in a.stderr and "auditor" not in a.stderr, a.stderr
    assert "global hooks" not in a.stderr  # torch.compile's warning about the auditor's own hooks
    # (torch 2.14's clean-up of a compiled function's code, when something keeps that code past the
    # teardown of dynamo's module, prints a traceback as the process ends)
    assert "Exception ignored" not in a.stderr and "Traceback" not in a.stderr, a.stderr
    (sync,) = a.rule("host-sync")
    line = COMPILED_CNN.splitlines().index("    if not torch.isfinite(loss):") + 1
    assert [(s["what"], s["line"], s["per_step"]) for s in sync["evidence"]["sites"]] == [("bool(Tensor)", line, 1.0)]
    (tmp_path / "cpu.py").write_text(COMPILED_CNN.replace('"cuda"', '"cpu"'))
    subprocess.run([sys.executable, str(tmp_path / "cpu.py")], check=True, capture_output=True, cwd=tmp_path,
                   env={**env, "PARITY_OUT": str(tmp_path / "plain.pt"), "PATH": os.environ.get("PATH", "")},
                   timeout=600)
    want = torch.load(tmp_path / "plain.pt", weights_only=True)
    got = torch.load(tmp_path / "audited.pt", weights_only=True)
    assert got["breaks"] == want["breaks"] == 0 and got["graphs"] == want["graphs"]
    assert_same_state(_flat({"net": want["net"], "opt": want["opt"]}), _flat({"net": got["net"], "opt": got["opt"]}))


MASKED_LOSS = '''
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
emb, head = nn.Embedding(50, 16, padding_idx=0).cuda(), nn.Linear(16, 5).cuda()
opt = torch.optim.SGD(list(emb.parameters()) + list(head.parameters()), lr=0.1)
tokens = torch.randint(0, 50, (8, 12)).cuda()
tags = torch.randint(0, 5, (8, 12)).cuda()
keep = torch.rand(8, 12) > 0.5  # on the host: selecting with it reads nothing from the GPU


def step(i):
    logits = head(emb(tokens))
    mask = tokens != 0
    selected = F.cross_entropy(logits[mask], tags[mask])
    weighted = (F.cross_entropy(logits.transpose(1, 2), tags, reduction='none') * mask).sum() / mask.sum()
    loss = selected + weighted
    opt.zero_grad()
    loss.backward()
    opt.step()
    kept = logits.detach()[keep]
    best = logits.detach().amax(-1)
    best[mask] = 0.0  # a host number: torch fills the mask in place (masked_fill_), reading nothing back
    best[mask] = best.new_ones(1)  # a GPU value: index_put_ turns the mask into indices, a nonzero
'''


@pytest.fixture(scope="module")
def masked_losses(tmp_path_factory):
    """MASKED_LOSS audited for 4 steps: both forms of the masked loss, each at its own line of one step."""
    trainer = tmp_path_factory.mktemp("masked") / "masked.py"
    trainer.write_text(MASKED_LOSS)
    return audit("run", f"{trainer}:step", "--steps", "4", "--no-profile", "--quiet", out=trainer.parent / "out",
                 env=QUIET_ENV)


@pytest.mark.parametrize("loss,syncs", [
    ("selected = F.cross_entropy(logits[mask], tags[mask])", 2.0),
    ("weighted = (F.cross_entropy(logits.transpose(1, 2), tags, reduction='none') * mask).sum() / mask.sum()", None),
])
def test_selecting_with_a_boolean_mask_of_the_gpu_is_a_sync(masked_losses, loss, syncs):
    """logits[mask] sizes its result by the mask's count of True values, which a GPU must hand back
    to the host first (a nonzero and a sync per selection): a masked token loss syncs twice a step.
    It went unreported (nonzero was probed, the selection that makes it was not). The same loss
    weighted by the mask, and a selection with a host mask, read nothing back: in the same step as
    the selection, their lines are no sync site."""
    a = masked_losses
    assert a.returncode == 0, a.evidence["ending"]
    lines = MASKED_LOSS.splitlines()
    line = lines.index(f"    {loss}") + 1
    (f,) = a.rule("host-sync")
    sites = [(s["what"], s["line"], s["per_step"]) for s in f["evidence"]["sites"]]
    syncs_at = {t["where"]["line"] for t in tallies(a, m.SYNC)}  # every sync the probes counted, reported or not
    if syncs is None:
        assert line not in syncs_at and lines.index("    kept = logits.detach()[keep]") + 1 not in syncs_at
        assert all(site_line != line for _, site_line, _ in sites)
        return
    assert [site for site in sites if site[1] == line] == [("Tensor[bool mask]", line, syncs)]
    assert "torch.where(mask, x, 0)" in f["fix"]["summary"]


def test_assigning_a_gpu_value_through_a_boolean_mask_of_the_gpu_is_a_sync(masked_losses):
    """`t[mask] = values` turns the mask into indices on the way into index_put_ (a nonzero, a
    sync), as pytorch/tutorials' DQN does with `next_state_values[non_final_mask] = ...` every
    update; `t[mask] = 0.0` is a masked_fill_ on the device and reads nothing back."""
    a = masked_losses
    lines = MASKED_LOSS.splitlines()
    filled = lines.index("    best[mask] = 0.0  # a host number: torch fills the mask in place (masked_fill_), reading nothing back") + 1
    assigned = filled + 1
    (f,) = a.rule("host-sync")
    sites = [(s["what"], s["line"], s["per_step"]) for s in f["evidence"]["sites"]]
    assert ("Tensor[bool mask] = tensor", assigned, 1.0) in sites
    assert filled not in {t["where"]["line"] for t in tallies(a, m.SYNC)}
    assert "masked_scatter_(mask, values)" in f["fix"]["summary"]


SLICED_BATCHES = '''import torch
from torch import nn
import torch.nn.functional as F

device = "cuda"
torch.manual_seed(0)
data = torch.randint(0, 64, (4096,), device=device)  # the token stream kept on the GPU
emb, head = nn.Embedding(64, 16).to(device), nn.Linear(16, 64).to(device)
opt = torch.optim.AdamW([*emb.parameters(), *head.parameters()], lr=1e-3)
T = 16


def step(i):
    ix = torch.randint(len(data) - T - 1, (8,), device=device)
    x = torch.stack([data[j:j + T] for j in ix])  # SLICED LINE
    y = data[ix[:, None] + 1 + torch.arange(T, device=device)]  # GATHERED LINE
    loss = F.cross_entropy(head(emb(x)).view(-1, 64), y.view(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


def test_slicing_with_a_gpu_tensor_bound_is_a_sync(tmp_path):
    """`data[j:j + T]` for `j` in a GPU tensor: the host reads each `j` (`__index__`) to slice, one
    sync a slice, which torch makes below the indexing call (no `.item()` of the user's to probe).
    Gathering the same rows by an index tensor reads nothing back."""
    trainer = tmp_path / "sliced.py"
    trainer.write_text(SLICED_BATCHES)
    a = audit("run", f"{trainer}:step", "--steps", "4", "--no-profile", "--quiet", out=tmp_path / "out", env=QUIET_ENV)
    assert a.returncode == 0, a.evidence["ending"]
    lines = SLICED_BATCHES.splitlines()
    sliced = next(n for n, text in enumerate(lines, 1) if "SLICED LINE" in text)
    gathered = next(n for n, text in enumerate(lines, 1) if "GATHERED LINE" in text)
    (f,) = a.rule("host-sync")
    assert [(s["what"], s["line"], s["per_step"]) for s in f["evidence"]["sites"]] == [
        ("Tensor[tensor:slice]", sliced, 8.0)]
    assert gathered not in {t["where"]["line"] for t in tallies(a, m.SYNC)}
    assert "ix.tolist()" in f["fix"]["summary"]
