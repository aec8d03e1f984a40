"""An output directory may be shared: another user can plant a symbolic link at a name the audit
writes there (the lock, records.jsonl, the write test, tb/) to make the audit overwrite a file of
their choosing. A planted link is never followed: the audit refuses it with one line (exit 2) and
the file it points at is left as it was; a link planted while the audit writes is refused too
(auditor.evidence.whole_files)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import FIXTURES, audit

TRACE = FIXTURES / "traces" / "a100_item_sync_small.pt.trace.json.gz"
QUICK = ("examples/clean.py:step", "--steps", "2", "--no-profile", "--no-numerics", "--quiet")


def victim(tmp_path: Path, name: str = "victim") -> Path:
    path = tmp_path / name
    path.write_text("the user's own file\n")
    return path


@pytest.mark.parametrize("name", [".audit-lock", "records.jsonl", "evidence.json"])
def test_a_link_planted_in_out_is_refused_and_its_target_left_alone(tmp_path: Path, name: str) -> None:
    out = tmp_path / "shared"
    out.mkdir()
    target = victim(tmp_path)
    (out / name).symlink_to(target)
    a = audit("run", *QUICK, out=out)
    assert a.returncode == 2, a.stderr
    [line] = a.stderr.splitlines()
    assert line == (f"audit: error: --out {out}: {name} there is a symbolic link (to {target}); the audit never "
                    "writes through one: remove it or choose another directory")
    assert target.read_text() == "the user's own file\n"
    assert not (out / "findings.json").exists()


def test_analyze_refuses_a_planted_lock(tmp_path: Path) -> None:
    out = tmp_path / "shared"
    out.mkdir()
    target = victim(tmp_path)
    (out / ".audit-lock").symlink_to(target)
    a = audit("analyze", str(TRACE), "-q", out=out)
    assert a.returncode == 2 and "symbolic link" in a.stderr, a.stderr
    assert target.read_text() == "the user's own file\n"


def test_a_planted_tb_directory_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "shared"
    out.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / "tb").symlink_to(elsewhere, target_is_directory=True)
    a = audit("run", "examples/clean.py:step", "--steps", "4", "--no-numerics", "--quiet", out=out)
    assert a.returncode == 2 and "tb there is a symbolic link" in a.stderr, a.stderr
    assert list(elsewhere.iterdir()) == []


def test_the_write_test_is_never_a_name_that_can_be_planted(tmp_path: Path) -> None:
    """The write test's name was `.audit-write-test-<pid>`: a link planted there had its target
    created. Its name is now the audit's own, made with O_EXCL."""
    out = tmp_path / "shared"
    out.mkdir()
    target = tmp_path / "created-by-the-audit"
    (out / f".audit-write-test-{os.getpid()}").symlink_to(target)  # (the audit runs in this process)
    a = audit("run", *QUICK, out=out)
    assert a.returncode == 0, a.stderr
    assert not target.exists()


def test_a_link_planted_while_an_output_is_written_is_refused(tmp_path: Path) -> None:
    """The race: the name is checked when the write begins and again when it is renamed into place;
    the temporary file itself is made by the audit (O_EXCL), so a link at its name fails it."""
    from auditor.evidence.whole_files import LinkRefused, WholeFile, make_dirs, write_whole

    target = victim(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    f = WholeFile(out / "report.html")
    f.write(b"<html>")
    (out / "report.html").symlink_to(target)
    with pytest.raises(LinkRefused, match="report.html is a symbolic link"):
        f.commit()
    assert target.read_text() == "the user's own file\n"
    assert sorted(p.name for p in out.iterdir()) == ["report.html"]  # (the link; no temporary file left)
    with pytest.raises(LinkRefused):
        write_whole(out / "report.html", "x")
    with pytest.raises(LinkRefused):
        make_dirs(out, "report.html", "run")
    assert target.read_text() == "the user's own file\n"
