"""Outputs are written whole or not at all. On a full filesystem (a small tmpfs, mounted for the
test) an audit exits 2 (the environment's to fix), leaves the files an earlier audit wrote as they
were, names on the terminal each output it could not write, and leaves no partial file behind;
`audit run` still shows what it found."""
from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from conftest import FIXTURES, audit

TRACE = FIXTURES / "traces" / "a100_item_sync_small.pt.trace.json.gz"
OUTPUTS = ("evidence.json", "findings.json", "findings.sarif", "report.html", "summary.txt")


@pytest.fixture
def small_fs(tmp_path: Path):
    """A 16 MiB tmpfs of this test's own (the machine's root may mount one; elsewhere skipped)."""
    fs = tmp_path / "fs"
    fs.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(fs)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield fs
    finally:
        subprocess.run(["umount", "-l", str(fs)], check=False)


def fill(fs: Path) -> None:
    """Take every free byte of the filesystem."""
    with open(fs / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError:
            pass


def digests(out: Path) -> dict[str, str]:
    return {n: hashlib.sha256((out / n).read_bytes()).hexdigest() for n in OUTPUTS if (out / n).is_file()}


def test_analyze_on_a_full_disk_keeps_the_earlier_outputs_and_exits_2(small_fs: Path) -> None:
    out = small_fs / "out"
    first = audit("analyze", str(TRACE), "-q", out=out)
    assert first.returncode == 0, first.stderr
    before = digests(out)
    assert set(before) == set(OUTPUTS)
    fill(small_fs)
    a = audit("analyze", str(TRACE), out=out)
    assert a.returncode == 2, a.stderr
    assert "internal error" not in a.stderr
    for name in OUTPUTS:
        assert f"could not write {name}: No space left on device" in a.stderr
    assert "report: not written" in a.stdout
    assert "not written (see the warnings above): " + ", ".join(
        ["evidence.json", "findings.json", "report.html", "findings.sarif", "summary.txt"]) in a.stdout
    assert digests(out) == before  # the earlier audit's, whole
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no partial file left


def test_run_on_a_full_disk_shows_its_findings_and_exits_2(small_fs: Path) -> None:
    """The run goes on: its evidence stays in memory, the summary prints, what was lost is named."""
    fill(small_fs)
    out = small_fs / "run"
    a = audit("run", "examples/host_sync.py:step", "--steps", "4", "--no-numerics", out=out)
    assert a.returncode == 2, a.stderr
    assert "internal error" not in a.stderr + a.stdout
    assert "host-sync" in a.stdout  # the findings, from the evidence the run kept
    assert "not written (see the warnings above): records.jsonl, the profiler's trace (tb/host_sync-step/" in a.stdout
    assert "evidence.json, findings.json, report.html, findings.sarif, summary.txt" in a.stdout
    assert not [p for p in out.rglob("*") if p.is_file() and p.stat().st_size and p.name != "filler"]


# The profiler's exporter on a disk that fills while it writes: Kineto writes `<path>.tmp`, then
# renames it; on a full disk the rename never comes, and its `.tmp` stays where it was written.
FILLING_EXPORT = '''
import errno, torch.profiler.profiler as p


def export_chrome_trace(self, path, *args, **kwargs):
    with open(path + ".tmp", "wb") as f:
        f.write(b"[" * 57000)
    raise OSError(errno.ENOSPC, "No space left on device", path)


p.profile.export_chrome_trace = export_chrome_trace
'''


def test_what_the_profilers_export_leaves_on_a_full_disk_is_removed(tmp_path: Path) -> None:
    """The window's calibration export and the window's own: neither leaves its `.tmp` (57 KB each
    here) in --out; the trace is named as not written."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(FILLING_EXPORT)
    out = tmp_path / "out"
    a = audit("run", "examples/host_sync.py:step", "--steps", "6", "--no-numerics", out=out,
              env={"PYTHONPATH": str(inject)})
    assert a.returncode == 2, a.stderr
    assert [p.relative_to(out).as_posix() for p in out.rglob("*") if p.name.startswith(".")] == []
    assert "the profiler's trace (tb/host_sync-step/)" in a.stdout
    assert not (out / "tb" / "host_sync-step").exists() or not list((out / "tb" / "host_sync-step").iterdir())
