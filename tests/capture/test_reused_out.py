"""A reused --out: an earlier audit's trace of another target was kept in tb/, where TensorBoard
showed it beside this run's. The traces the earlier audit's evidence.json named are removed once
this run's evidence replaces it; nothing the audit did not write is (a user's own traces in ./tb
with `--out .`), and a run that never starts (a usage error) removes nothing."""
from __future__ import annotations

import hashlib
from pathlib import Path

from conftest import EXAMPLES, audit
from quoted_out_run import STALE, USERS, quoted_out_run


def test_an_earlier_audits_traces_are_removed(tmp_path_factory) -> None:
    a = quoted_out_run(tmp_path_factory)  # (an --out with a quote and a backslash: test_trace_path)
    out = a.out
    assert a.returncode == 0, a.stderr
    assert not (out / STALE).exists()  # (written there before the run, named by the earlier evidence.json)
    assert (out / USERS).read_text() == '{"traceEvents": []}'  # (named by none: not the audit's)
    left = sorted(p.relative_to(out).as_posix() for p in (out / "tb").glob("*/*.pt.trace.json*") if p != out / USERS)
    assert left == sorted(a.evidence["profile"]["trace_files"]) and left


def test_a_users_own_traces_in_the_current_directory_are_kept(tmp_path: Path) -> None:
    """`--out .` in a project whose own profiler runs write ./tb/<run>/: they are the user's."""
    mine = [tmp_path / "tb" / "clean-step" / "worker0.1.pt.trace.json", tmp_path / "tb" / "exp" / "w.2.pt.trace.json.gz"]
    for p in mine:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b'{"traceEvents": []}')
    a = audit("run", f"{EXAMPLES / 'clean.py'}:step", "--steps", "4", "--no-numerics", "-q", "--out", ".",
              out=tmp_path, cwd=tmp_path)
    assert a.returncode == 0, a.stderr
    assert all(p.read_bytes() == b'{"traceEvents": []}' for p in mine)
    [own] = a.evidence["profile"]["trace_files"]
    assert own.startswith("tb/clean-step/") and (tmp_path / own).is_file()


def digests(out: Path) -> dict[str, str]:
    return {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in out.rglob("*") if p.is_file() and p.name != ".audit-lock"}


def test_a_usage_error_into_an_earlier_runs_out_leaves_it_whole(tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = audit("run", "examples/clean.py:step", "--steps", "4", "--no-numerics", "-q", out=out)
    assert first.returncode == 0, first.stderr
    before = digests(out)
    assert "records.jsonl" in before and any(k.startswith("tb/") for k in before)
    again = audit("run", "examples/clean.py:no_such_step", "--steps", "4", "-q", out=out)
    assert again.returncode == 2 and "no callable 'no_such_step'" in again.stderr, again.stderr
    assert digests(out) == before
