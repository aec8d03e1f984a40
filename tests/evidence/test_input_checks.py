"""Inputs that used to be taken for something they are not: unrelated run directories merged as the
ranks of one job, a TARGET file that is not Python run as if it were, and misspelled keys of
[tool.auditor] ignored. Each is a usage error: one line on stderr, exit 2, no traceback."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import audit, balanced_ddp_run, plain_run

ONE_LINE = "only one `audit run` directory can be analyzed at a time"


def one_line_error(a, contains: str) -> str:
    assert a.returncode == 2, (a.stdout, a.stderr)
    lines = [ln for ln in a.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, a.stderr
    assert lines[0].startswith("audit: error:") and contains in lines[0], lines[0]
    assert "Traceback" not in a.stderr + a.stdout
    return lines[0]


# ---------------------------------------------------------------------------------------------
# `audit analyze DIR DIR...`: several run directories are ranks of one distributed job, or an error.

@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory) -> dict[str, Path]:
    """Two unrelated single-process runs (the session's plain runs: test_report_plots reads clean's)."""
    def run(name: str) -> Path:
        a = plain_run(tmp_path_factory, name)
        assert a.returncode == 0, a.stderr[-4000:]
        return a.out
    return {name: run(name) for name in ("demo", "clean")}


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> Path:
    """A real 2-rank job: DIR/rank-0/, DIR/rank-1/ and the merged report in DIR/."""
    out = balanced_ddp_run(tmp_path_factory)
    assert (out / "rank-0" / "evidence.json").is_file() and (out / "rank-1" / "evidence.json").is_file()
    return out


def test_two_unrelated_runs_are_not_two_ranks(plain_runs, tmp_path):
    a = audit("analyze", str(plain_runs["demo"]), str(plain_runs["clean"]), "--quiet", out=tmp_path / "o")
    one_line_error(a, ONE_LINE)
    assert not (tmp_path / "o").exists()  # no report of a made-up "2 ranks" job


def test_one_run_given_twice_is_not_two_ranks(plain_runs, tmp_path):
    a = audit("analyze", str(plain_runs["demo"]), str(plain_runs["demo"]), "--quiet", out=tmp_path / "o")
    one_line_error(a, ONE_LINE)
    assert not (tmp_path / "o").exists()


def test_one_rank_directory_given_twice_is_refused(ddp_run, tmp_path):
    rank0 = ddp_run / "rank-0"
    a = audit("analyze", str(rank0), str(rank0), "--quiet", out=tmp_path / "o")
    assert "given twice" in one_line_error(a, ONE_LINE)
    # the same directory under another spelling is still the same directory
    a = audit("analyze", str(rank0), f"{ddp_run}/../{ddp_run.name}/rank-0", "--quiet", out=tmp_path / "o")
    one_line_error(a, "given twice")


def test_ranks_of_one_job_still_merge(ddp_run, tmp_path):
    for r in (0, 1):  # as if each node kept its own directory
        shutil.copytree(ddp_run / f"rank-{r}", tmp_path / f"node{r}" / f"rank-{r}")
    a = audit("analyze", str(tmp_path / "node0" / "rank-0"), str(tmp_path / "node1" / "rank-1"), "--quiet",
              out=tmp_path / "o")
    assert a.returncode == 0, a.stderr
    assert [r["rank"] for r in a.evidence["ranks"]["ranks"]] == [0, 1]
    assert any("Merged from 2 rank(s) (0-1 of 2)" in n for n in a.evidence["environment"]["notes"])


def test_ranks_of_two_different_jobs_do_not_merge(ddp_run, tmp_path):
    other = tmp_path / "other" / "rank-1"  # rank 1 of another launch of the same script
    shutil.copytree(ddp_run / "rank-1", other)
    doc = json.loads((other / "evidence.json").read_text())
    doc["rank"]["run_id"] = "another-launch"
    (other / "evidence.json").write_text(json.dumps(doc))
    a = audit("analyze", str(ddp_run / "rank-0"), str(other), "--quiet", out=tmp_path / "o")
    assert "another run" in one_line_error(a, ONE_LINE)


def test_a_plain_run_is_not_a_rank_of_a_job(ddp_run, plain_runs, tmp_path):
    a = audit("analyze", str(ddp_run / "rank-0"), str(plain_runs["clean"]), "--quiet", out=tmp_path / "o")
    assert "not a rank of a distributed run" in one_line_error(a, ONE_LINE)


def test_the_merged_report_is_not_one_more_rank(ddp_run, tmp_path):
    a = audit("analyze", str(ddp_run), str(ddp_run / "rank-1"), "--quiet", out=tmp_path / "o")
    one_line_error(a, ONE_LINE)


# ---------------------------------------------------------------------------------------------
# `audit run FILE:callable` with a FILE that is not Python.

@pytest.mark.parametrize("name", ["plain.pt", "notes.txt", "train"])
def test_a_target_file_that_is_not_python(tmp_path, name):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / name).write_text("def step():\n    pass\n")
    a = audit("run", f"bad/{name}:step", "--steps", "2", "--quiet", out=tmp_path / "o", cwd=tmp_path)
    line = one_line_error(a, f"{name}: not a Python file")
    assert "path/to/file.py:callable" in line
    assert not (tmp_path / "o").exists()  # refused before any child started


# ---------------------------------------------------------------------------------------------
# [tool.auditor]: a misspelled key must not silently turn a setting (a CI gate) off.

def _run_with_config(tmp_path: Path, toml: str):
    (tmp_path / "t.py").write_text("def step():\n    pass\n")
    (tmp_path / "pyproject.toml").write_text(toml)
    return audit("run", f"{tmp_path / 't.py'}:step", "--steps", "2", "--quiet", "--no-profile",
                 out=tmp_path / "o", cwd=tmp_path)


@pytest.mark.parametrize("toml,contains", [
    ('[tool.auditor]\nfail_on = "warning"\n', "unknown key 'fail_on' in [tool.auditor] (did you mean 'fail-on'?)"),
    ('[tool.auditor]\nignored = ["host-sync"]\n', "unknown key 'ignored' in [tool.auditor] (did you mean 'ignore'?)"),
    ('[tool.auditor]\nselected = ["host-sync"]\n', "(did you mean 'select'?)"),
    ('[tool.auditor]\nfailon = "error"\n', "(did you mean 'fail-on'?)"),
    ('[tool.auditor.rule.host-sync]\nmin-share-of-steps = 0.5\n', "unknown key 'rule' in [tool.auditor] "
                                                                   "(did you mean 'rules'?)"),
    ('[tool.auditor.host-sync]\nmin-share-of-steps = 0.5\n', "(did you mean [tool.auditor.rules.host-sync]?)"),
    ('[tool.auditor]\nverbose = true\n', "unknown key 'verbose' in [tool.auditor] (known: fail-on, ignore, rules, "
                                         "select)"),
])
def test_unknown_keys_of_the_table(tmp_path, toml, contains):
    one_line_error(_run_with_config(tmp_path, toml), contains)
    assert not (tmp_path / "o").exists()


def test_known_keys_still_work(tmp_path):
    a = _run_with_config(tmp_path, '[tool.auditor]\nselect = ["host-sync"]\nignore = ["forced-cleanup"]\n'
                                   'fail-on = "error"\n[tool.auditor.rules.host-sync]\nmin-share-of-steps = 0.5\n')
    assert a.returncode == 0, a.stderr


def test_a_rank_directory_that_cannot_be_read_is_listed_and_the_rest_merged(ddp_run, tmp_path):
    """Rank directories are reduced one by one (auditor.evidence.ranks.merge.merge_rank_dirs): an
    unreadable one is named with its reason, the others analysed; before, it ended the whole job's
    analysis with exit 2."""
    for r in (0, 1):
        shutil.copytree(ddp_run / f"rank-{r}", tmp_path / "job" / f"rank-{r}")
    (tmp_path / "job" / "rank-1" / "evidence.json").write_text('{"truncated": ')
    a = audit("analyze", str(tmp_path / "job"), "--quiet", out=tmp_path / "o")
    assert a.returncode == 0, a.stderr
    assert "1 rank input(s) not read, the other 1 analysed" in a.stderr
    assert "rank-1/evidence.json: not a readable auditor evidence file" in a.stderr
    rs = a.evidence["ranks"]
    assert [r["rank"] for r in rs["ranks"]] == [0] and rs["missing"] == [1]
    assert [Path(u["path"]).name for u in rs["unread"]] == ["rank-1"]
    (tmp_path / "job" / "rank-0" / "evidence.json").write_text("")
    one_line_error(audit("analyze", str(tmp_path / "job"), "--quiet", out=tmp_path / "o2"),
                   "none of the 2 rank run directories could be read")
