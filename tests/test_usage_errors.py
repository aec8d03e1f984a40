"""Bad input: one clear line on stderr, exit 2, no traceback."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import FIXTURES, audit, plain_run

# A step with nothing of a trainer's in it, for the tests of what `audit run` says and writes
# rather than what it finds: its child imports torch but never an optimizer (whose first call
# imports torch._dynamo, ~1.1 s of CPU a run).
TINY = "import torch\nw = torch.zeros(3)\nbatches = w.tolist()\n\n\ndef step():\n    w.add_(1)\n"


@pytest.fixture
def tiny(tmp_path):
    """TINY as tmp_path/tiny.py."""
    path = tmp_path / "tiny.py"
    path.write_text(TINY)
    return path


def one_line_error(a, contains: str):
    assert a.returncode == 2, (a.stdout, a.stderr)
    lines = [ln for ln in a.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, a.stderr
    assert lines[0].startswith("audit: error:") and contains in lines[0]
    assert "Traceback" not in a.stderr + a.stdout


@pytest.mark.parametrize("target,contains", [
    ("examples/nope.py", "no such file"),  # (a file without :callable is a whole program: tests/test_programs.py)
    ("examples/nope.py:step", "no such file"),
    # (TINY imported by the audit's child, which looks the name up in it)
    ("{tiny}:nope", "no callable 'nope'"),
    ("{tiny}:batches", "not callable"),
    ("no_such_pkg.train:step", "no such module"),
    ("examples/clean.py:", "bad TARGET"),
])
def test_bad_targets(tmp_path, tiny, target, contains):
    one_line_error(audit("run", target.format(tiny=tiny), "--steps", "2", out=tmp_path / "o"), contains)


def test_step_with_two_required_arguments(tmp_path):
    path = tmp_path / "t.py"
    path.write_text("def step(a, b):\n    pass\n")
    one_line_error(audit("run", f"{path}:step", out=tmp_path / "o"), "no argument or one")
    # nothing ran: no --out directory is left behind (it held only records.jsonl, which `audit
    # analyze` then refused as "not an audit run directory")
    assert not (tmp_path / "o").exists()


def test_step_with_a_required_keyword_only_argument(tmp_path):
    """`def step(*, i)` cannot be called as `step()` or `step(i)`: refused up front (it ran, and
    failed at step 0 with exit 3). Refused into an --out that exists, the folder is left as it was
    (as test_step_with_two_required_arguments's, that did not, is not made)."""
    path = tmp_path / "t.py"
    path.write_text("def step(*, i):\n    pass\n")
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    one_line_error(audit("run", f"{path}:step", "--steps", "2", out=tmp_path / "kept"), "keyword-only argument 'i'")
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("source,contains", [
    ("def step(i):\n    yield i\n", "step is a generator function"),
    ("async def step(i):\n    return i\n", "step is an async function"),
])
def test_a_step_whose_call_runs_nothing(tmp_path, source, contains):
    """Calling a generator or async function returns at once and runs none of its body: auditing
    it would report a clean, instant run of nothing."""
    path = tmp_path / "t.py"
    path.write_text(source)
    one_line_error(audit("run", f"{path}:step", "--steps", "2", out=tmp_path / "o"), contains)


@pytest.mark.parametrize("args,contains", [
    (("run", "examples/clean.py:step", "--steps", "0"), "--steps"),
    (("run", "examples/clean.py:step", "--select", "no-such-rule"), "unknown rule id 'no-such-rule'"),
    (("run", "examples/clean.py:step", "--fail-on", "fatal"), "--fail-on"),
    (("explain", "no-such-rule"), "no rule 'no-such-rule'"),
    (("analyze", "does/not/exist.json"), "no such file"),
    (("frobnicate",), "No such command"),
    # -m runs a module instead of TARGET: a TARGET before `--` was passed on to the program unsaid
    (("run", "-m", "json.tool", "stray.json"), "'stray.json' was given too: the program's own arguments go after `--`"),
])
def test_bad_options(tmp_path, args, contains):
    one_line_error(audit(*args, out=tmp_path / "o"), contains)


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """A package whose train.py imports a sibling relatively: (its folder, the audit of
    `mypkg.train:step` from there, 3 steps unprofiled). One run serves both tests that need the
    module form to work."""
    root = tmp_path_factory.mktemp("package")
    pkg = root / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "util.py").write_text("X = 1\n")
    (pkg / "train.py").write_text("import torch\n\nfrom .util import X\n\nw = torch.zeros(3)\n\n\n"
                                  "def step():\n    w.add_(X)\n")
    a = audit("run", "mypkg.train:step", "--steps", "3", "--quiet", "--no-profile", out=root / "o", cwd=root)
    return root, a


def test_module_target_and_python_dash_m(package):
    """`package.module:callable` works, through `python -m auditor` (as torchrun needs)."""
    _, a = package
    assert a.returncode == 0, a.stderr
    assert a.findings_doc["steps"]["count"] == 3


def test_launcher_mode_reports_a_missing_callable_as_a_usage_error(tmp_path):
    """Under --nproc-per-node the ranks' own exit 2 would be lost in the launcher's failure: the
    callable is checked first, without running the module."""
    a = audit("run", "examples/clean.py:nope", "--nproc-per-node", "2", "--steps", "2", out=tmp_path / "o")
    one_line_error(a, "no callable 'nope'")
    assert not (tmp_path / "o").exists()


def test_an_output_directory_that_cannot_be_written(tmp_path):
    import torch

    (tmp_path / "afile").write_text("")
    torch.save({"w": torch.ones(2)}, tmp_path / "ok.pt")
    trace = min((FIXTURES / "traces").glob("*.json*"), key=lambda f: f.stat().st_size)
    for args in (("run", "examples/clean.py:step"), ("analyze", str(trace)), ("checkpoint", str(tmp_path / "ok.pt"))):
        a = audit(*args, "--out", str(tmp_path / "afile" / "sub"), out=tmp_path / "o")
        one_line_error(a, f"--out {tmp_path / 'afile' / 'sub'}: cannot write there")


def test_a_target_path_that_is_not_utf8(tmp_path):
    """Every report names the file: a path no report can be written with is refused up front."""
    d = tmp_path / "bad\udcffdir"  # (the byte 0xff, as Python holds an undecodable file name)
    d.mkdir()
    (d / "t.py").write_text("def step():\n    pass\n")
    one_line_error(audit("run", f"{d / 't.py'}:step", out=tmp_path / "o"), "is not valid UTF-8")


def test_a_package_file_with_relative_imports_gets_the_module_form_as_a_hint(tmp_path, package):
    """`python mypkg/train.py` fails the same way; the report says how to name it instead."""
    root, module_form = package
    # (the setup fails at its import: no step, so no profiler, runs)
    a = audit("run", "mypkg/train.py:step", "--steps", "2", "--quiet", "--no-profile", out=tmp_path / "o", cwd=root)
    assert a.returncode == 3
    message = a.findings_doc["ending"]["message"]
    assert message.startswith("attempted relative import") and f"from {root}: audit run mypkg.train:step" in message
    # the hint's command, run from there, works
    assert module_form.returncode == 0 and module_form.findings_doc["target"].startswith("mypkg.train"), \
        module_form.stderr


def test_a_path_too_long_to_look_up(tmp_path):
    """A path the system refuses to look up (a name past 255 bytes, a path past 4096): looking it
    up raised OSError(ENAMETOOLONG), which ended every command as an internal error (exit 4)."""
    import torch

    torch.save({"w": torch.ones(2)}, tmp_path / "ok.pt")
    name = "n" * 300
    deep = "d/" * 2100 + "x.json"
    cases = [("analyze", f"{name}.json"), ("analyze", deep), ("checkpoint", f"{name}.pt"), ("report", name),
             ("run", f"{name}.py:step"), ("checkpoint", str(tmp_path / "ok.pt"), "--against", f"{name}.yaml")]
    for args in cases:
        a = audit(*args, out=tmp_path / "o", cwd=tmp_path)
        one_line_error(a, "file name too long")
        assert len(a.stderr) < 300 and f"({len(args[-1] if args[0] != 'run' else name + '.py'):,} characters)" in a.stderr
    assert not (tmp_path / "o").exists()


def test_report_into_a_run_directory_that_cannot_be_written(tmp_path, tmp_path_factory):
    """`audit report DIR` writes the reports back into DIR: a run copied read-only from a cluster
    ended as an internal error (PermissionError on evidence.json, exit 4). It is a usage error
    that says where the reports can go instead; `audit analyze DIR --out` then writes them."""
    import os
    import shutil
    import subprocess
    import sys

    run = plain_run(tmp_path_factory, "clean")  # (the session's 5-step run: copied, never written)
    assert run.returncode == 0, run.stderr
    ro = tmp_path / "ro"
    shutil.copytree(run.out, ro)
    for p in [*ro.rglob("*"), ro]:
        p.chmod(0o555 if p.is_dir() else 0o444)
    # root ignores file modes: drop the capabilities that let it (as a user account is)
    prefix = (["setpriv", "--bounding-set", "-dac_override,-dac_read_search"] if os.geteuid() == 0 else [])
    if prefix and not shutil.which("setpriv"):
        pytest.skip("running as root without setpriv: a read-only directory cannot be made")
    try:
        p = subprocess.run([*prefix, sys.executable, "-m", "auditor", "report", str(ro)], capture_output=True,
                           text=True, timeout=120)
        a = type(run)(p.returncode, p.stdout, p.stderr, ro)
        one_line_error(a, f"{ro}: cannot write the reports there (Permission denied); "
                          f"`audit analyze {ro} --out DIR` writes them elsewhere")
        p = subprocess.run([*prefix, sys.executable, "-m", "auditor", "analyze", str(ro), "--out", str(tmp_path / "o"),
                            "--quiet"], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        assert json.loads((tmp_path / "o" / "findings.json").read_text())["steps"]["count"] == 5
    finally:
        for q in [ro, *ro.rglob("*")]:
            q.chmod(0o755 if q.is_dir() else 0o644)


def test_a_long_file_name_still_gets_a_default_output_directory(tmp_path):
    """`audit checkpoint <a 240-character name>.pt` named its default output directory
    checkpoint-<name>-<timestamp>, past the 255 bytes a file name may have: it failed with
    '--out ...: cannot write there', an option the user never gave."""
    import torch

    ckpt = tmp_path / f"{'c' * 240}.pt"
    torch.save({"w": torch.ones(2)}, ckpt)
    cmd = [sys.executable, "-m", "auditor", "checkpoint", str(ckpt), "--quiet"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    [out] = (tmp_path / "audit-out").iterdir()
    assert out.name.startswith(f"checkpoint-{'c' * 89}-") and len(out.name) <= 100 + 16
    assert json.loads((out / "findings.json").read_text())["target"] == str(ckpt)


@pytest.mark.parametrize("out,contains", [("", "--out: an empty path"), ("a\nb", "control character")])
def test_an_empty_out_or_one_with_a_newline_is_refused(tmp_path, out, contains):
    """`--out ""` wrote into the current directory over its report.html; a newline in --out lost
    the profiler trace silently. Both are refused in one line, before anything runs."""
    (tmp_path / "report.html").write_text("mine")
    a = audit("run", "examples/clean.py:step", "--steps", "2", "--out", out, out=tmp_path, cwd=tmp_path)
    one_line_error(a, contains)
    assert (tmp_path / "report.html").read_text() == "mine"


def test_an_out_with_an_earlier_audit_says_it_is_replaced(tmp_path, tiny):
    """A second audit into one --out replaced the first silently: a line on stderr says so."""
    for expected in ("", "holds an earlier audit's outputs"):
        a = audit("run", f"{tiny}:step", "--steps", "2", "--quiet", "--no-profile", out=tmp_path / "o")
        assert a.returncode == 0 and expected in a.stderr, a.stderr


def test_a_newline_in_the_targets_path_keeps_the_profiler_trace(tmp_path):
    """A target file whose name holds a newline: its run's name (the trace directory) has "_"
    for it, and the trace is written and analysed (it was lost without a word)."""
    d = tmp_path / "a\nb"
    d.mkdir()
    (d / "t\nx.py").write_text("import torch\nw = torch.ones(8, 8)\n\ndef step():\n    (w @ w).sum()\n")
    a = audit("run", f"{d / ('t' + chr(10) + 'x.py')}:step", "--steps", "6", "--quiet", out=tmp_path / "o")
    assert a.returncode == 0, a.stderr
    assert a.evidence["traces"] and a.evidence["traces"][0].startswith("tb/t_x-step/")


def test_a_second_audit_into_an_out_in_use_is_refused(tmp_path, tiny):
    """Two audits into one --out at the same time overwrote each other's files without a word: the
    second is refused in one line while the first holds the directory; after it, the directory is
    free again and holds no lock file."""
    import fcntl
    import os

    from auditor.app import LOCK_FILE

    out = tmp_path / "o"
    out.mkdir()
    fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running audit holds it
    os.write(fd, b"4242")
    try:
        one_line_error(audit("run", f"{tiny}:step", "--steps", "2", "--no-profile", out=out),
                       "another audit is writing there now (pid 4242)")
        assert not (out / "evidence.json").exists()
    finally:
        os.close(fd)
    a = audit("run", f"{tiny}:step", "--steps", "2", "--no-profile", "--quiet", out=out)
    assert a.returncode == 0, a.stderr
    assert (out / "evidence.json").is_file() and not (out / LOCK_FILE).exists()
