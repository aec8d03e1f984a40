"""auditor from Python (auditor.api, docs/python.md): the audit the commands make, as an Audit;
read back with load; its errors the commands' messages and exit codes; the page's code run here."""
from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import auditor
from auditor import app, cli
from auditor.command_options import AnalyzeOptions, RunOptions
from conftest import FIXTURES, ROOT, audit

TRACE = FIXTURES / "traces" / "h100_bert_small_item_sync.pt.trace.json.gz"
PAGE = ROOT / "docs" / "python.md"


@pytest.fixture
def here(tmp_path, monkeypatch) -> Path:
    """A working directory holding the page's trace where the page names it (a copy: a symbolic
    link would lead out of it, and a run directory's recordings are read under it only)."""
    (tmp_path / "tests" / "fixtures" / "traces").mkdir(parents=True)
    shutil.copy(TRACE, tmp_path / "tests" / "fixtures" / "traces" / TRACE.name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_analyze_gives_the_findings_the_command_writes(here) -> None:
    """The findings DataFrame holds findings.json's findings, the same that `audit analyze` writes
    for the trace: host-sync at line 429 (0.008 ms a step) and line 34, gpu-idle counted only."""
    a = auditor.analyze(TRACE, out=here / "api")
    command = audit("analyze", str(TRACE), out=here / "cli")
    assert command.returncode == a.exit_code == 0
    assert [f["rule"] for f in command.findings] == a.findings["rule"].tolist() == ["host-sync", "host-sync", "gpu-idle"]
    assert list(a.findings.columns) == ["rule", "severity", "file", "line", "ms_per_step", "share", "message"]
    first = a.findings.iloc[0]
    assert (first.file, first.line, first.ms_per_step) == ("transformers/modeling_attn_mask_utils.py", 429, 0.008)
    assert a.findings["message"].tolist() == [f["message"] for f in command.findings]
    assert a.findings["line"].tolist() == [429, 34, 181] and pd_isna(a.findings["ms_per_step"].iloc[2])
    assert a.run_time.base_ms == command.findings_doc["run_time"]["base_ms"] == pytest.approx(4.426)
    assert a.steps[["step", "ms", "device_ms", "role"]].to_dict("records") == [
        {"step": 6, "ms": 4.426, "device_ms": 0.309, "role": "recorded"}]
    assert set(a.paths) >= {"findings.json", "report.html", "evidence.json"} and a.report.is_file()


def pd_isna(value) -> bool:
    import pandas as pd

    return bool(pd.isna(value))


def test_load_reads_back_the_same_audit(here) -> None:
    """load() of the outputs gives the same findings and steps; `diff` compares as `audit diff`
    (the copy under the working directory: a run directory's recordings are read under it only)."""
    a = auditor.analyze(Path("tests/fixtures/traces") / TRACE.name, out="o", fail_on="info")
    again = auditor.load("o")
    assert again.findings.equals(a.findings) and again.steps.equals(a.steps)
    assert again.out == a.out == here / "o"
    assert a.exit_code == 1 and again.exit_code == 0  # (--fail-on is the call's, not the directory's)
    assert a.fixes.config == '# Settings\ntorch.compile = {"mode": "reduce-overhead"}  # gpu-idle'
    assert a.fixes.patch == ""
    d = a.diff(again)
    assert d.step_pct == d.run_pct == 0.0 and d.findings["status"].tolist() == ["kept"] * 3


def test_the_commands_and_the_functions_call_the_same_pipelines(monkeypatch) -> None:
    """`audit analyze` / `audit run` and auditor.analyze / auditor.run hand app.analyze / app.run the
    same options record (the calls' quiet and named output directory aside)."""
    got: list = []
    monkeypatch.setattr(app, "analyze", lambda paths, options: got.append((paths, options)) or 0)
    monkeypatch.setattr(app, "run", lambda target, options, module=None, args=(): got.append(
        (target, options, module, tuple(args))) or 0)
    with pytest.raises(SystemExit):
        cli.main(["analyze", str(TRACE), "--select", "host-sync", "--out", "x"])
    with pytest.raises(SystemExit):
        cli.main(["run", "-m", "pkg.train", "--steps", "7", "--no-numerics", "--out", "y", "--", "--lr", "1"])
    with pytest.raises(auditor.AuditError):  # (nothing written by the stand-ins: no audit to read)
        auditor.analyze(TRACE, select=("host-sync",), out="x", quiet=False)
    with pytest.raises(auditor.AuditError):
        auditor.run("pkg.train", steps=7, numerics=False, args=["--lr", 1], module=True, out="y", quiet=False)
    assert got[0] == got[2] == ((TRACE,), AnalyzeOptions(select=("host-sync",), out=Path("x")))
    # (with -m, click hands the program's first argument as TARGET: app.run joins them)
    assert [app.run_target(t, m, args)[1] for t, _, m, args in (got[1], got[3])] == [("--lr", "1")] * 2
    assert got[1][1:3] == got[3][1:3] == (RunOptions(steps=7, numerics=False, out=Path("y")), "pkg.train")


@pytest.mark.parametrize("call, argv", [
    (lambda: auditor.analyze("missing.json"), ["analyze", "missing.json"]),
    (lambda: auditor.run("nope.py"), ["run", "nope.py"]),
    (lambda: auditor.analyze(TRACE, device="no-such-gpu"), ["analyze", str(TRACE), "--device", "no-such-gpu"]),
    (lambda: auditor.load("."), None),
])
def test_errors_carry_the_commands_message_and_exit_code(tmp_path, monkeypatch, call, argv) -> None:
    """An audit that cannot be made raises AuditError with the line `audit` prints and its exit
    code, and leaves no output directory behind."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(auditor.AuditError) as e:
        call()
    assert e.value.exit_code == 2 and str(e.value) == e.value.message
    if argv is not None:
        command = audit(*argv, out=tmp_path / "cli", cwd=tmp_path)
        assert command.returncode == 2
        assert command.stderr.strip().splitlines()[-1] == f"audit: error: {e.value.message}"
    assert not (tmp_path / "audit-out").exists() or not any((tmp_path / "audit-out").iterdir())


def test_an_option_refused_names_its_keyword() -> None:
    with pytest.raises(auditor.AuditError, match=r"^steps: expected `int` >= 1$") as e:
        auditor.run("train.py", steps=0)
    assert e.value.exit_code == 2
    with pytest.raises(auditor.AuditError, match="^stepz: no such option$"):
        auditor.analyze(TRACE, stepz=3)


STEP = """\
import torch

calls = 0


def step():
    global calls
    calls += 1
    if calls == 4:
        raise RuntimeError("batch 4 is bad")
    x = torch.ones(64, 64, requires_grad=True)
    (x @ x).sum().backward()
"""


def test_run_returns_the_audit_of_a_failed_run(tmp_path, monkeypatch) -> None:
    """auditor.run audits the step in a child process; a step that raises still gives its Audit,
    exit code 3 as the command's, its steps the three that ran and the failed one."""
    (tmp_path / "train.py").write_text(STEP)
    monkeypatch.chdir(tmp_path)
    a = auditor.run("train.py:step", steps=6, out="run", profile=False, numerics=False)
    assert a.exit_code == 3 and a.document["ending"]["status"] == "raised"
    assert a.steps["role"].tolist() == ["timed"] * 3 + ["failed"]
    assert (a.steps["ms"] > 0).all() and a.steps["cpu_ms"].notna().all()
    assert "The run raised" in a._repr_html_() and "batch 4 is bad" in a._repr_html_()


def test_the_first_screen_escapes_what_the_audit_holds(tmp_path) -> None:
    """A recording named like markup shows as text: its name escaped, never a tag."""
    trace = tmp_path / "<img src=x onerror=alert(1)>.pt.trace.json.gz"
    shutil.copy(TRACE, trace)
    html = auditor.analyze(trace, out=tmp_path / "o")._repr_html_()
    assert "<img" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html
    assert html.count("<tr") == 3 + 1 + 3  # (the three cards, the findings' header, the three findings)
    assert "4.43 ms/step (1 steps, 0.00 s): work 4.41, syncs 0.01" in html


def test_import_auditor_stays_light() -> None:
    """The audited program imports auditor (auditor.step()): the API's libraries wait for a call."""
    code = ("import sys, auditor; print(sorted(m for m in ('pandas', 'torch', 'numpy', 'click', 'auditor.api', "
            "'msgspec') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _blocks(page: Path) -> list[tuple[str, str]]:
    """(language, text) of each fenced block of the page, in order."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```$", page.read_text(), re.S | re.M)]


def test_the_page_runs(here) -> None:
    """docs/python.md's `python` blocks run in order, in one namespace, on the trace the project
    carries; a block's printed output is the `text` block after it. (Its `py` block runs a user's
    program, shown only: it must parse.)"""
    blocks = _blocks(PAGE)
    names: dict = {}
    ran = 0
    for i, (language, text) in enumerate(blocks):
        if language == "py":
            compile(text, f"{PAGE.name}: py block", "exec")
        if language != "python":
            continue
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(text, f"{PAGE.name}: block {i}", "exec"), names)
        ran += 1
        if i + 1 < len(blocks) and blocks[i + 1][0] == "text":
            assert printed.getvalue() == blocks[i + 1][1]
    assert ran == 4
    assert json.loads((here / "audit-out" / "bert" / "findings.json").read_text())["findings"]
