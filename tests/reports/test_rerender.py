"""`audit report DIR` re-renders a saved audit: the same findings as the first render, from the same
recordings, and the directory left as it was found, so that it can be re-rendered (or moved, then
re-rendered) any number of times."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import FIXTURES, Audit, audit

TRACE = FIXTURES / "traces" / "v100_resnet50_dataloader_workers0.pt.trace.json.gz"
SNAPSHOT = FIXTURES / "snapshots" / "fragmented_72gb_state_only.pickle"
OWL = FIXTURES / "traces" / "h100_owlv2_syncs_dataloader.pt.trace.json.gz"

# Makes writing report.html fail, as a read-only file does for anyone but root (who may write it
# anyway, and who runs the suite in some containers)
READ_ONLY_REPORT = '''
import os

_replace = os.replace


def replace(src, dst, *args, **kwargs):
    if os.path.basename(dst) == "report.html":
        raise PermissionError(13, "Permission denied", str(dst))
    return _replace(src, dst, *args, **kwargs)


os.replace = replace
'''


def rules(a: Audit) -> list[str]:
    return sorted(f["rule"] for f in a.findings)


def notes(a: Audit) -> list[str]:
    return a.findings_doc["environment"]["notes"]


def saved(run: Path) -> dict:
    return json.loads((run / "evidence.json").read_text())


@pytest.mark.parametrize("recording", [TRACE, SNAPSHOT], ids=["trace", "snapshot"])
def test_report_of_recordings_named_relative_to_the_cwd_keeps_the_findings(tmp_path: Path, recording: Path) -> None:
    """The recordings are named relative to where `audit analyze` ran, and the saved evidence is
    read back relative to the output directory: it must name them absolutely."""
    (tmp_path / "rel").mkdir()
    shutil.copy(recording, tmp_path / "rel")
    name = f"rel/{recording.name}"
    first = audit("analyze", name, "--out", "out", "-q", out=tmp_path / "out", cwd=tmp_path)
    want = rules(first)  # (read now: the re-render rewrites findings.json)
    assert first.returncode == 0 and want, first.stderr
    again = audit("report", "out", out=tmp_path / "out", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert rules(again) == want
    assert not any("missing" in n for n in notes(again)), notes(again)
    ev = again.evidence
    assert ev["traces"] + ev["snapshots"] == [str((tmp_path / name).resolve())]


def test_a_reported_run_directory_can_still_be_moved(tmp_path: Path, example_audit) -> None:
    """A run's own traces are saved relative to its directory; a re-render must not pin them to
    where the directory was then."""
    run = tmp_path / "run"
    shutil.copytree(example_audit("graph_leak").out, run)
    before = saved(run)
    first = audit("report", str(run), out=run)
    assert first.returncode == 0, first.stderr
    assert saved(run) == before
    skipped = first.findings_doc["skipped_rules"]
    moved = tmp_path / "moved"
    run.rename(moved)
    again = audit("report", str(moved), out=moved)
    assert again.returncode == 0, again.stderr
    assert again.findings_doc["skipped_rules"] == skipped
    assert rules(again) == ["graph-leak"]
    assert not any("missing" in n for n in notes(again)), notes(again)


def test_notes_do_not_pile_up_over_re_renders(tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = audit("analyze", str(OWL), "-q", out=out)
    assert first.returncode == 0, first.stderr
    want = notes(first)
    [device] = [n for n in want if n.startswith("device as recorded in")]
    stored = saved(out)
    for _ in range(3):
        again = audit("report", str(out), out=out)
        assert again.returncode == 0, again.stderr
        assert notes(again) == want
        assert notes(again).count(device) == 1
        assert saved(out) == stored
    assert device in (out / "report.html").read_text()


def test_a_missing_trace_is_noted_once_and_not_for_good(tmp_path: Path, example_audit) -> None:
    """A note about what loading found is about the files as they are now: said once per render, and
    gone once the trace is back."""
    run = tmp_path / "run"
    shutil.copytree(example_audit("graph_leak").out, run)
    before = saved(run)
    [trace] = before["traces"]
    kept = tmp_path / "kept-trace"
    (run / trace).rename(kept)
    gone = audit("report", str(run), out=run)
    assert gone.returncode == 0, gone.stderr
    assert len([n for n in notes(gone) if "missing" in n]) == 1, notes(gone)
    assert saved(run) == before
    skipped = len(gone.findings_doc["skipped_rules"])
    kept.rename(run / trace)
    back = audit("report", str(run), out=run)
    assert not any("missing" in n for n in notes(back)), notes(back)
    assert len(back.findings_doc["skipped_rules"]) < skipped


def test_a_report_that_could_not_be_written_is_not_claimed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert audit("analyze", str(TRACE), "-q", out=out).returncode == 0
    (out / "report.html").chmod(0o444)
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(READ_ONLY_REPORT)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(inject), os.environ.get("PYTHONPATH")) if p)}
    a = audit("report", str(out), out=out, env=env, process=True)  # (its interpreter loads the injection)
    assert a.returncode == 2 and "could not write report.html" in a.stderr
    assert str(out / "report.html") not in a.stdout, a.stdout
    assert "report: not written" in a.stdout, a.stdout
    assert str(out / "findings.json") in a.stdout  # what was written is still named
    q = audit("analyze", str(TRACE), "-q", out=out, env=env, process=True)
    assert q.returncode == 2 and "could not write report.html" in q.stderr
    assert "report in" not in q.stdout and "report not written" in q.stdout, q.stdout
