"""A command stopped by SIGTERM (a job scheduler's stop, `kill`) outside a run's child ends as a
Ctrl-C ends it: one line, exit 3, and nothing of its own left behind (no temporary file, no lock);
the default output directory of two audits of one target started in the same second is each its own."""
from __future__ import annotations

import os
from pathlib import Path

from auditor import app
from conftest import FIXTURES, audit

TRACE = FIXTURES / "traces" / "a100_item_sync_small.pt.trace.json.gz"

# SIGTERM to the audit itself as it is about to put report.html in place (as a scheduler's stop lands
# in the report phase): the rename never runs
TERM_AT_REPORT = '''
import os, signal

_replace = os.replace


def replace(src, dst, *args, **kwargs):
    if os.path.basename(dst) == "report.html":
        os.kill(os.getpid(), signal.SIGTERM)
    return _replace(src, dst, *args, **kwargs)


os.replace = replace
'''


def injected(tmp_path: Path) -> dict:
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(TERM_AT_REPORT)
    return {"PYTHONPATH": str(inject)}


def left(out: Path) -> list[str]:
    return sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.name.startswith("."))


def test_sigterm_to_analyze_leaves_no_temporary_file_nor_its_lock(tmp_path: Path) -> None:
    out = tmp_path / "out"
    a = audit("analyze", str(TRACE), "-q", out=out, env=injected(tmp_path), process=True)
    assert (a.returncode, a.stderr) == (3, "audit: stopped by SIGTERM\n")
    assert left(out) == []
    assert not (out / "report.html").exists()


def test_sigterm_in_a_runs_report_phase_is_honoured(tmp_path: Path) -> None:
    """The run itself completed; the stop still ends the audit (exit 3, as a SIGTERM during the run)."""
    out = tmp_path / "out"
    a = audit("run", "examples/clean.py:step", "--steps", "2", "--no-profile", "--no-numerics", "-q", out=out,
              env=injected(tmp_path), process=True)
    assert (a.returncode, a.stderr) == (3, "audit: stopped by SIGTERM\n")
    assert left(out) == []
    assert (out / "evidence.json").is_file() and not (out / "report.html").exists()


def test_two_audits_of_one_target_in_one_second_get_a_directory_each(tmp_path: Path, monkeypatch) -> None:
    """The second exited 2: "another audit is writing there now"."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(app.time, "strftime", lambda fmt: "20250101-120000")
    first = app.output_dir(None, "train")
    app._release_all()  # (as if the first were another process: this one holds no lock on it)
    (first / ".audit-lock").write_text("12345")  # (its lock file, held by that process)
    second = app.output_dir(None, "train")
    assert (first, second) == (Path("audit-out/train-20250101-120000"), Path("audit-out/train-20250101-120000-2"))
    assert os.listdir(second) == [".audit-lock"]
    app._release_all()
