"""fixes.patch is checked the way a user uses it: `git apply` in a real repository.

Each case writes files into a fresh git repo, asks for edits, and compares the tree after
`git apply` with the expected text, so a diff that git rejects or applies wrongly fails here.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from auditor.evidence.model import Evidence
from auditor.fixes import apply_edits, make_patch, patch_path, plan_edits
from auditor.reports.patch import PatchReport
from auditor.findings import Edit, Finding, Fix
from auditor.findings import RuleResults

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")

TRAIN = """\
import torch

def step(model, batch, opt):
    loss = model(batch).sum()
    print(loss.item())
    loss.backward()
    opt.step()
    torch.cuda.empty_cache()
    return loss
"""


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "proj"
    (root / "src").mkdir(parents=True)
    assert _git(root, "init", "-q").returncode == 0
    (root / "src" / "train.py").write_text(TRAIN)
    (root / "util.py").write_text("a = 1\nb = 2\nc = 3")  # no final newline
    return root


def _apply(repo: Path, patch: str) -> None:
    (repo.parent / "fixes.patch").write_text(patch)
    check = _git(repo, "apply", "--check", "-v", str(repo.parent / "fixes.patch"))
    assert check.returncode == 0, check.stderr + "\n" + patch
    assert _git(repo, "apply", str(repo.parent / "fixes.patch")).returncode == 0


def _finding(rule: str, edits: list[Edit], numerics: bool = False) -> Finding:
    return Finding(rule=rule, severity="warning", title=rule, message=f"{rule} message",
                   fix=Fix(summary=f"fix {rule}", edits=edits, changes_numerics=numerics))


def test_report_joins_findings_into_one_patch_git_accepts(repo: Path) -> None:
    train = repo / "src" / "train.py"
    util = repo / "util.py"
    results = RuleResults(findings=[
        _finding("host-sync", [Edit(str(train), 5, 5, ["    # print(loss.item())  # syncs every step"])]),
        _finding("forced-cleanup", [Edit(str(train), 8, 8, [])]),  # delete the empty_cache line
        _finding("overlapping", [Edit(str(train), 4, 5, ["    pass"])]),  # overlaps host-sync's edit
        _finding("numerics", [Edit(str(train), 1, 1, ["import numpy"])], numerics=True),
        _finding("tail", [Edit(str(util), 3, 3, ["c = 4"]), Edit(str(util), 4, 3, ["d = 5"])]),
    ])
    patch = PatchReport().render(Evidence(), results, repo)
    assert "diff --git a/src/train.py b/src/train.py" in patch
    assert "diff --git a/util.py b/util.py" in patch
    assert "# Left out (overlapping): " in patch and "overlap another edit" in patch
    # every fix it holds, one a line, the one that changes results marked for review
    assert ("#   numerics train.py:1 [changes results: review it]\n#   host-sync train.py:5\n#   forced-cleanup train.py:8\n"
            "#   tail util.py:3\n") in patch
    _apply(repo, patch)
    assert train.read_text() == TRAIN.replace("    print(loss.item())", "    # print(loss.item())  # syncs every step") \
        .replace("    torch.cuda.empty_cache()\n", "").replace("import torch", "import numpy")
    assert util.read_text() == "a = 1\nb = 2\nc = 4\nd = 5"


def test_paths_are_relative_to_git_toplevel_from_anywhere(repo: Path, monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # outside the repository
    assert patch_path(repo / "src" / "train.py") == "src/train.py"
    outside = tmp_path / "loose.py"
    outside.write_text("x = 1\n")
    assert patch_path(outside) == "loose.py"  # not in a repo: relative to the current directory


def test_make_patch_for_one_fix_applies(repo: Path) -> None:
    train = repo / "src" / "train.py"
    patch = make_patch([Edit(str(train), 3, 2, ["@torch.no_grad()"])])  # insert before line 3
    assert patch.startswith("diff --git a/src/train.py b/src/train.py\n--- a/src/train.py\n+++ b/src/train.py\n")
    _apply(repo, patch)
    assert train.read_text().splitlines()[2:4] == ["@torch.no_grad()", "def step(model, batch, opt):"]


def test_no_patchable_edits_renders_empty(repo: Path) -> None:
    results = RuleResults(findings=[Finding(rule="x", severity="info", title="x", message="no fix")])
    assert PatchReport().render(Evidence(), results, repo) == ""


def test_a_patch_file_is_written_only_when_it_holds_a_patch(repo: Path, tmp_path: Path) -> None:
    """An empty fixes.patch makes `git apply` fail ("No valid patches in input"): with no edit for
    it, the file is not written, and one an earlier audit left in the directory is removed (and an
    older audit's numerics-fixes.patch with it, known by its first line)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "fixes.patch").write_text("stale")
    (out / "numerics-fixes.patch").write_text("# auditor numerics-fixes.patch: code edits that change ...\n")
    only_plain = RuleResults(findings=[_finding("host-sync", [Edit(str(repo / "util.py"), 1, 1, ["a = 0"])])])
    PatchReport().write(Evidence(), only_plain, out)
    assert (out / "fixes.patch").read_text().startswith("# auditor fixes.patch")
    assert not (out / "numerics-fixes.patch").exists()
    none = RuleResults(findings=[Finding(rule="x", severity="info", title="x", message="no fix")])
    PatchReport().write(Evidence(), none, out)
    assert not (out / "fixes.patch").exists()


def test_a_users_own_file_named_like_the_older_patch_is_left_alone(repo: Path, tmp_path: Path) -> None:
    """The audit deletes only what an audit made: a numerics-fixes.patch of the user's own (another
    first line), or a link of that name, stays as it was."""
    out = tmp_path / "out"
    out.mkdir()
    mine = "my notes on numerics\n"
    (out / "numerics-fixes.patch").write_text(mine)
    target = tmp_path / "elsewhere.patch"
    target.write_text("# auditor numerics-fixes.patch: planted\n")
    results = RuleResults(findings=[_finding("host-sync", [Edit(str(repo / "util.py"), 1, 1, ["a = 0"])])])
    PatchReport().write(Evidence(), results, out)
    assert (out / "numerics-fixes.patch").read_text() == mine
    (out / "numerics-fixes.patch").unlink()
    (out / "numerics-fixes.patch").symlink_to(target)
    PatchReport().write(Evidence(), results, out)
    assert (out / "numerics-fixes.patch").is_symlink() and target.read_text().startswith("# auditor numerics")


def test_an_edit_that_changes_results_is_in_the_one_patch_and_marked(repo: Path) -> None:
    """Edits that change results are in fixes.patch with the others, marked for review in its
    preamble; of two edits of one line, the one that changes results is taken (on a DataLoader call
    it carries the other's setting too) and the other is named as left out."""
    util = repo / "util.py"
    results = RuleResults(findings=[
        _finding("host-sync", [Edit(str(util), 3, 3, ["c = 4"])]),
        _finding("pageable-copy", [Edit(str(util), 2, 2, ["b = 'pinned'"])]),
        _finding("nonfinite", [Edit(str(util), 1, 1, ["a = 0"])], numerics=True),
        _finding("dataloader-bound", [Edit(str(util), 2, 2, ["b = 'pinned, workers'"])], numerics=True),
    ])
    patch = PatchReport().render(Evidence(), results, repo)
    lines = patch.splitlines()
    assert lines[2:5] == ["#   nonfinite util.py:1 [changes results: review it]",
                          "#   dataloader-bound util.py:2 [changes results: review it]", "#   host-sync util.py:3"]
    assert "pageable-copy" not in "\n".join(lines[2:5]) and "# Left out (pageable-copy): util.py:2-2: " in patch
    _apply(repo, patch)
    assert util.read_text() == "a = 0\nb = 'pinned, workers'\nc = 4"


def test_crlf_file_keeps_its_line_endings(repo: Path) -> None:
    win = repo / "win.py"
    win.write_bytes(b"a = 1\r\nb = 2\r\n")
    _git(repo, "config", "core.autocrlf", "false")
    _apply(repo, make_patch([Edit(str(win), 2, 2, ["b = 3"])]))
    assert win.read_bytes() == b"a = 1\r\nb = 3\r\n"


@pytest.mark.parametrize("edits, taken, skipped", [
    ([Edit("f", 2, 3, ["x"]), Edit("f", 3, 4, ["y"])], 1, 1),  # overlapping replacements
    ([Edit("f", 2, 3, ["x"]), Edit("f", 4, 4, ["y"])], 2, 0),  # adjacent: both fine
    ([Edit("f", 2, 1, ["x"]), Edit("f", 2, 1, ["y"])], 1, 1),  # two insertions at one point
    ([Edit("f", 2, 1, ["x"]), Edit("f", 2, 1, ["x"])], 1, 0),  # the same edit twice: once
    ([Edit("f", 2, 4, ["x"]), Edit("f", 3, 2, ["y"])], 1, 1),  # insertion inside a replacement
    ([Edit("f", 2, 4, ["x"]), Edit("f", 2, 1, ["y"])], 2, 0),  # insertion just before it
    ([Edit("f", 9, 9, ["x"])], 0, 1),  # past the end of a 5-line file
])
def test_plan_edits(edits: list[Edit], taken: int, skipped: int) -> None:
    plan = plan_edits(edits, line_count=5)
    assert (len(plan.taken), len(plan.skipped)) == (taken, skipped)


def test_apply_edits_bottom_up_keeps_line_numbers_valid() -> None:
    lines = [f"{i}\n" for i in range(1, 7)]
    out = apply_edits(lines, [Edit("f", 2, 2, ["two", "two-b"]), Edit("f", 5, 6, [])])
    assert out == ["1\n", "two\n", "two-b\n", "3\n", "4\n"]


def test_a_patch_of_a_file_outside_the_run_directory_says_to_apply_it_from_the_root(tmp_path: Path, monkeypatch) -> None:
    """`audit run ../train.py` outside a repository: the patch names the file by its absolute path
    (git apply refuses `..`), so its preamble says to apply it from `/`, where it applies."""
    here, there = tmp_path / "runs", tmp_path / "code"
    here.mkdir()
    there.mkdir()
    train = there / "train.py"
    train.write_text(TRAIN)
    monkeypatch.chdir(here)
    results = RuleResults(findings=[_finding("forced-cleanup", [Edit(str(train), 8, 8, [])])])
    patch = PatchReport().render(Evidence(), results, here)
    lines = patch.splitlines()
    assert lines[1] == (f"# Apply from the filesystem's root: cd / && git apply {(here / 'fixes.patch').resolve()} "
                        f"({train.resolve()} is outside the repository and the directory the audit ran in, so the "
                        "patch names it by its absolute path)")
    (here / "fixes.patch").write_text(patch)
    assert subprocess.run(["git", "apply", "--check", str(here / "fixes.patch")], cwd=here,
                          capture_output=True).returncode != 0
    check = subprocess.run(["git", "apply", "--check", str(here / "fixes.patch")], cwd="/", capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    (here / "t.py").write_text("x = 1\n")  # (a file where the audit ran: the usual line)
    inside = PatchReport().render(Evidence(), RuleResults(findings=[
        _finding("forced-cleanup", [Edit(str(here / "t.py"), 1, 1, [])])]), here)
    assert inside.splitlines()[1] == "# Apply at the repository root (or where the audit ran): git apply fixes.patch"
