"""A recording names source files by whatever paths it holds. `audit analyze` quotes source only
from files under the roots the user names (`--source-root`): a trace naming /etc/passwd, a `../..`
path out of the root or a symlink out of it gets its frames shown by path and line alone, and none
of those files' text reaches any output."""
from __future__ import annotations

import json
import os
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
