"""fixes.patch end to end: `git apply` takes it in the user's tree, and the patched trainer then
audits clean for the rules whose fixes it carries."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from conftest import EXAMPLES, audit


def git(cwd, *args):
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=cwd, check=True,
                   capture_output=True)


@pytest.mark.parametrize("name,steps,rules", [
    ("demo", 10, {"graph-leak", "peak-stats-reset"}),
    ("retained_graph", 30, {"retained-graph"}),
    ("forced_cleanup", 30, {"forced-cleanup"}),
])
def test_patch_applies_and_the_patched_trainer_audits_clean(tmp_path, example_audit, name, steps, rules):
    """The example's audit is the session's shared one (test_diff's demo, test_examples' others:
    read, never written); its patches apply to a repository holding the example, and the patched
    example, audited for as many steps, has none of the findings they fix."""
    before = example_audit(name, steps)
    assert before.returncode == 0, before.stderr
    assert {f["rule"] for f in before.findings} >= rules
    for f in before.findings:
        if f["rule"] in rules:  # each finding carries its own diff too
            assert f["fix"]["patch"].startswith(f"diff --git a/examples/{name}.py b/examples/{name}.py")
    repo = tmp_path / "repo"
    (repo / "examples").mkdir(parents=True)
    for f in (f"{name}.py", "_common.py"):
        shutil.copy(EXAMPLES / f, repo / "examples" / f)
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "trainer")
    patch = before.out / "fixes.patch"
    subprocess.run(["git", "apply", "--check", str(patch)], cwd=repo, check=True)
    subprocess.run(["git", "apply", str(patch)], cwd=repo, check=True)
    changed = subprocess.run(["git", "diff", "--name-only"], cwd=repo, capture_output=True, text=True).stdout
    assert changed.split() == [f"examples/{name}.py"]
    after = audit("run", f"examples/{name}.py:step", "--steps", str(steps), "--quiet", out=tmp_path / "after", cwd=repo)
    assert after.returncode == 0, after.stderr
    assert not rules & {f["rule"] for f in after.findings}
