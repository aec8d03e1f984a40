"""A recording names source files by whatever paths it holds. `audit analyze` quotes source only
from files under the roots the user names (`--source-root`): a trace naming /etc/passwd, a `../..`
path out of the root or a symlink out of it gets its frames shown by path and line alone, and none
of those files' text reaches any output."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from conftest import ROOT, audit

HERE = {"PYTHONPATH": str(ROOT)}  # (this checkout's auditor, run from another directory)

SECRET = [f"SECRET_{n}_never_quoted = {n}" for n in range(1, 9)]


def sync_site(frame: str, ts: int, correlation: int) -> list[dict]:
    """A host sync under the Python frame `frame` (a torch 2 trace's `file(line): function`)."""
    return [
        {"ph": "X", "cat": "python_function", "name": frame, "pid": 1, "tid": 1, "ts": ts, "dur": 80, "args": {}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::item", "pid": 1, "tid": 1, "ts": ts + 10, "dur": 60, "args": {}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "pid": 1, "tid": 1, "ts": ts + 20,
         "dur": 40, "args": {"correlation": correlation}},
    ]


def crafted(tmp_path: Path) -> tuple[Path, Path]:
    """(the source root, a trace naming a file in it and three outside it)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.py").write_text("\n".join(SECRET[:4]) + "\n")
    (outside / "linked.py").write_text("\n".join(SECRET[4:]) + "\n")
    root = tmp_path / "proj" / "code"
    root.mkdir(parents=True)
    (root / "ok.py").write_text("import torch\n\n\ndef helper(x):\n    y = x * 2\n    return y.sum().item()\n")
    os.symlink(outside / "linked.py", root / "link.py")
    frames = ["ok.py(4): helper", "/etc/passwd(1): passwd", "../../outside/secret.py(2): secret",
              f"{root}/../../outside/secret.py(3): secret", "link.py(2): link"]
    events = [e for i, f in enumerate(frames) for e in sync_site(f, 1000 * (i + 1), i + 1)]
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    return root, trace


def outputs(a) -> str:
    return a.stdout + a.stderr + "".join(p.read_text(errors="replace") for p in a.out.iterdir() if p.is_file())


def test_source_is_quoted_only_from_under_the_source_root(tmp_path: Path) -> None:
    root, trace = crafted(tmp_path)
    a = audit("analyze", str(trace), "--source-root", str(root), out=tmp_path / "out", cwd=tmp_path, env=HERE)
    assert a.returncode == 0, a.stderr
    text = outputs(a)
    for line in SECRET:
        assert line not in text
    passwd = [ln for ln in Path("/etc/passwd").read_text().splitlines() if ln.strip()]
    assert passwd and not any(ln in text for ln in passwd)
    # the file under the root is quoted; the others are named by path and line alone
    locs = {(loc["file"], loc["line"]): loc for f in a.rule("host-sync") for loc in f["locations"]}
    assert locs[("ok.py", 6)]["code"] == "return y.sum().item()"
    assert "return y.sum().item()" in (a.out / "report.html").read_text()
    for place in (("/etc/passwd", 1), ("../../outside/secret.py", 2), ("link.py", 2)):
        assert locs[place]["code"] == ""


def test_no_source_root_quotes_nothing(tmp_path: Path) -> None:
    """Without --source-root nothing of this machine is read, not even a file in the current directory."""
    root, trace = crafted(tmp_path)
    a = audit("analyze", str(trace), out=tmp_path / "out", cwd=root, env=HERE)
    assert a.returncode == 0, a.stderr
    assert "return y.sum().item()" not in outputs(a)
    assert {loc["code"] for f in a.rule("host-sync") for loc in f["locations"]} == {""}


def forged_run(tmp_path: Path, example_audit) -> tuple[Path, Path]:
    """(a copy of a real run directory whose evidence.json names a private file, outside the project
    and the current directory, where it named the example, with no stored sources and `/` for its
    roots, as recorded on this machine; that private file)."""
    private = tmp_path / "home" / "private.py"
    private.parent.mkdir()
    private.write_text("\n".join(SECRET * 3) + "\n")
    run = tmp_path / "forged"
    shutil.copytree(example_audit("graph_leak").out, run)
    doc = json.loads((run / "evidence.json").read_text())
    example = str(ROOT / "examples" / "graph_leak.py")
    doc = json.loads(json.dumps(doc).replace(json.dumps(example)[1:-1], json.dumps(str(private))[1:-1]))
    doc["sources"], doc["source_roots"] = {}, ["/"]
    (run / "evidence.json").write_text(json.dumps(doc))
    return run, private


def test_a_forged_run_directory_quotes_no_file_of_this_machine(tmp_path: Path, example_audit) -> None:
    """Its recorded roots were trusted when its hostname was this machine's: the private file's lines
    went into report.html and evidence.json. Only --source-root and the current directory are."""
    run, private = forged_run(tmp_path, example_audit)
    here = tmp_path / "elsewhere"
    here.mkdir()
    a = audit("analyze", str(run), out=tmp_path / "out", cwd=here, env=HERE)
    assert a.returncode == 0, a.stderr
    assert {loc["file"] for f in a.findings for loc in f["locations"]} >= {str(private)}
    text = outputs(a)
    for line in SECRET:
        assert line not in text


def test_a_run_directory_rendered_from_elsewhere_quotes_what_it_stored(tmp_path: Path, example_audit) -> None:
    """A real run, its project not under the current directory: the lines quoted are the ones its
    evidence.json stored when it was audited."""
    run = tmp_path / "run"
    shutil.copytree(example_audit("graph_leak").out, run)
    want = {f["rule"]: f["locations"][0]["code"] for f in json.loads((run / "findings.json").read_text())["findings"]}
    assert want["graph-leak"] == "running_loss += loss  # expect: graph-leak"
    a = audit("analyze", str(run), out=tmp_path / "out", cwd=tmp_path, env=HERE)
    assert a.returncode == 0, a.stderr
    assert {f["rule"]: f["locations"][0]["code"] for f in a.findings}["graph-leak"] == want["graph-leak"]


def test_a_run_directory_naming_a_trace_outside_it_is_refused(tmp_path: Path, example_audit) -> None:
    run = tmp_path / "forged"
    shutil.copytree(example_audit("graph_leak").out, run)
    elsewhere = tmp_path / "private.pt.trace.json"
    elsewhere.write_text('{"traceEvents": [{"ph": "X", "name": "SECRET_TRACE", "pid": 1, "tid": 1, "ts": 1, "dur": 2}]}')
    doc = json.loads((run / "evidence.json").read_text())
    doc["traces"] = [str(elsewhere)]
    (run / "evidence.json").write_text(json.dumps(doc))
    a = audit("analyze", str(run), out=tmp_path / "out", cwd=tmp_path, env=HERE)
    assert a.returncode == 2, a.stderr
    assert a.stderr == (f"audit: error: {run / 'evidence.json'}: names a recording outside its directory "
                        f"({elsewhere}); a run directory's recordings are its own: refused\n")


ATTENTION = '''import math

import torch
from torch import nn
from torch.nn import functional as F


class Attention(nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.qkv, self.proj, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = F.softmax(att, dim=-1)
        y = att @ v
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
'''

ADDER = '''import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from pkg.model import Attention  # noqa: E402

torch.manual_seed(0)
model = Attention()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for i in range(12):
    loss = model(torch.randn(8, 128, 32)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


def test_a_run_re_rendered_where_it_ran_quotes_the_projects_files_as_the_run_did(tmp_path: Path) -> None:
    """minGPT's shape: the script in projects/adder/ of a git checkout imports the model from the
    checkout's top (its sys.path), and the trace names that file `../../pkg/model.py`. `audit run`
    reads the checkout; `audit report` from the same directory read that directory alone, so
    unfused-attention fell back from the softmax's line to the function's, unquoted. It reads the
    current directory's checkout, as `audit run` does: the same line."""
    proj = tmp_path / "proj"
    (proj / "pkg").mkdir(parents=True)
    (proj / "pkg" / "__init__.py").write_text("")
    (proj / "pkg" / "model.py").write_text(ATTENTION)
    run_dir = proj / "projects" / "adder"
    run_dir.mkdir(parents=True)
    (run_dir / "adder.py").write_text(ADDER)
    subprocess.run(["git", "init", "-q"], cwd=proj, check=True)
    a = audit("run", "adder.py", "--steps", "10", out=tmp_path / "out", cwd=run_dir)
    assert a.returncode == 0, a.stderr[-3000:]
    softmax = ATTENTION.splitlines().index("        att = F.softmax(att, dim=-1)") + 1
    [f] = a.rule("unfused-attention")
    assert [(loc["line"], loc["code"]) for loc in f["locations"]] == [(softmax, "att = F.softmax(att, dim=-1)")]
    # (named by its path, not the trace's `../../pkg/model.py`, which reads from the run's directory alone)
    assert f["locations"][0]["file"] == str((proj / "pkg" / "model.py").resolve())
    r = audit("report", str(tmp_path / "out"), out=tmp_path / "out", cwd=run_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    [g] = [g for g in json.loads((tmp_path / "out" / "findings.json").read_text())["findings"]
           if g["rule"] == "unfused-attention"]
    assert g["locations"] == f["locations"]
