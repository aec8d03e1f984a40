"""`# audit: ignore[...]` comments on findings with several locations or several sites, and the
patches such findings carry (see auditor/rules/suppression.py for the semantics)."""
from __future__ import annotations

import os
import shutil

import pytest

from conftest import EXAMPLES, ROOT, audit

# (run from the project's folder, `python -m auditor` finds this tree's auditor on the path, not
# whichever copy the environment has installed)
HERE = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}


@pytest.fixture
def project(tmp_path):
    for name in ("dataloader_bound.py", "host_sync.py", "_common.py"):
        shutil.copy(EXAMPLES / name, tmp_path / name)
    return tmp_path


def run(project, name: str, steps: int = 8):
    return audit("run", f"{project / name}.py:step", "--steps", str(steps), "--quiet", "--no-profile",
                 out=project / "out", cwd=project, env=HERE)


def reanalyze(project):
    """The rules again on the saved run, reading the comments as they are now."""
    return audit("analyze", str(project / "out"), "--quiet", out=project / "again", cwd=project, env=HERE)


def comment(src, line: int, text: str) -> None:
    """Append `text` to line `line` (1-based) of `src`, dropping the example's `# expect:` marker."""
    lines = src.read_text().splitlines()
    lines[line - 1] = lines[line - 1].split("  # expect:")[0] + "  " + text
    src.write_text("\n".join(lines) + "\n")


def patch_text(a) -> str:
    """fixes.patch's text, '' where none was written."""
    return (a.out / "fixes.patch").read_text() if (a.out / "fixes.patch").exists() else ""


def test_a_comment_on_the_primary_location_or_its_statement_silences_the_finding(project):
    """dataloader-bound names the DataLoader call (lines 29-30) first and the line drawing the
    batch second. The comment on the call's first line, or on its closing line (where a formatter
    puts it), silences the finding: it used to stay, pointing at the second location, with a patch
    that rewrote the call and deleted the comment. A comment for another rule stays as written."""
    src = project / "dataloader_bound.py"
    original = src.read_text()
    a = run(project, "dataloader_bound")
    f = a.rule("dataloader-bound")[0]
    assert f["locations"][0]["line"] == 29 and len(f["locations"]) > 1, f["locations"]
    assert "num_workers" in patch_text(a)

    for line in (29, 30):
        src.write_text(original)
        comment(src, line, "# audit: ignore[dataloader-bound]")
        b = reanalyze(project)
        assert not b.rule("dataloader-bound"), (line, b.rule("dataloader-bound"))
        assert b.findings_doc["suppressed"] == 1
        assert "DataLoader(" not in patch_text(b) and "audit: ignore" not in patch_text(b)

    # A comment for another rule leaves the finding. The edit changes only the tokens it must, so a
    # comment on the call's closing line or on its first line stays where it is.
    src.write_text(original)
    comment(src, 30, "# audit: ignore[host-sync]")
    c = reanalyze(project)
    assert c.rule("dataloader-bound") and c.findings_doc["suppressed"] == 0
    added = [ln for ln in patch_text(c).splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    assert added and added[-1].endswith(")  # audit: ignore[host-sync]"), patch_text(c)
    assert not any(ln.startswith(("-loader", "+loader")) for ln in patch_text(c).splitlines()), patch_text(c)
    src.write_text(original)
    comment(src, 29, "# audit: ignore[host-sync]")
    c = reanalyze(project)
    assert c.rule("dataloader-bound") and c.findings_doc["suppressed"] == 0
    assert c.rule("dataloader-bound")[0]["fix"]["edits"], c.rule("dataloader-bound")
    context = [ln for ln in patch_text(c).splitlines() if ln.startswith(" loader = DataLoader(")]
    assert len(context) == 1 and context[0].endswith("# audit: ignore[host-sync]"), patch_text(c)


def test_a_suppressed_site_leaves_the_count_message_and_evidence(project):
    """host-sync adds both lines of the example (19 and 20) into one finding; with line 19
    suppressed the finding is about line 20 alone: it used to drop only the location and still
    count, name and list line 19."""
    a = run(project, "host_sync")
    f = a.rule("host-sync")[0]
    assert sorted(s["line"] for s in f["evidence"]["sites"]) == [19, 20]
    both = f["evidence"]["syncs_per_step"]

    comment(project / "host_sync.py", 19, "# audit: ignore[host-sync]")
    f = reanalyze(project).rule("host-sync")[0]
    assert [s["line"] for s in f["evidence"]["sites"]] == [20]
    assert [loc["line"] for loc in f["locations"]] == [20]
    assert f["evidence"]["syncs_per_step"] == both - 1.0
    assert "at 1 place(s)" in f["message"] and "line 19" not in f["message"], f["message"]

    comment(project / "host_sync.py", 20, "# audit: ignore[host-sync]")
    b = reanalyze(project)
    assert not b.rule("host-sync") and b.findings_doc["suppressed"] == 1
