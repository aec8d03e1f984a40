"""The project carries what its tests read: no test, doc, benchmark or module names a path outside the
project (a directory beside it, such as the `../shared` a development machine had), the recordings
the tests read are under tests/fixtures/ and each is described in its README."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import FIXTURES, ROOT

# Where the project's text lives; its recorded data (tests/fixtures) is not text to read.
SCANNED = ("README.md", "pyproject.toml", "mkdocs.yml", ".ci", "auditor", "bench", "docs", "examples", "tests")
SKIPPED_DIRS = {"__pycache__", ".venv", "audit-out", "site", "fixtures", ".pytest_cache"}
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yml", ".yaml", ".txt", ".cfg", ".ini", ".sh", ".html", ".js", ""}
# A path beside the project: the outside directory by name, or one level up from the project's root
# (`ROOT.parent`, `REPO.parent`, `".." / "x"`).
OUTSIDE = re.compile(r"\.\./shared|shared/(fixtures|tools)|[\"']shared[\"']\s*/|\b(ROOT|REPO)\.parent\b"
                     r"|[\"']\.\.[\"']\s*/")
PARENTS = re.compile(r"Path\(__file__\)\.resolve\(\)\.parents\[(\d+)\]")


def _text_files() -> list[Path]:
    out = []
    for top in SCANNED:
        p = ROOT / top
        files = [p] if p.is_file() else sorted(p.rglob("*")) if p.is_dir() else []
        for f in files:
            rel = f.relative_to(ROOT)
            if (f.is_file() and f.suffix in TEXT_SUFFIXES and not SKIPPED_DIRS & set(rel.parts[:-1])
                    and f != Path(__file__).resolve()):
                out.append(f)
    return out


def test_the_scan_reads_the_projects_text() -> None:
    names = {f.relative_to(ROOT).as_posix() for f in _text_files()}
    assert {"README.md", "tests/conftest.py", "docs/gpu.md", "auditor/evidence/devices.py", ".ci/run"} <= names


def test_no_file_names_a_path_outside_the_project() -> None:
    found = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}"
             for f in _text_files()
             for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1) if OUTSIDE.search(line)]
    assert not found, "\n".join(found)


def test_no_module_climbs_above_the_project_root() -> None:
    """`Path(__file__).resolve().parents[N]` stays at or below the root: N is at most the number of
    folders the file is in below the root."""
    found = []
    for f in _text_files():
        depth = len(f.relative_to(ROOT).parts) - 1  # parents[depth] is the root
        for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            for m in PARENTS.finditer(line):
                if int(m.group(1)) > depth:
                    found.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_fixtures_are_inside_the_project_and_each_is_described() -> None:
    assert FIXTURES.resolve().is_relative_to(ROOT) and FIXTURES.is_dir()
    readme = (FIXTURES / "README.md").read_text()
    files = sorted(p for p in FIXTURES.rglob("*") if p.is_file() and p.name != "README.md")
    assert files
    # each recording is named in the README (a run directory by its name: its files are the run's)
    undescribed = [p.relative_to(FIXTURES).as_posix() for p in files
                   if p.name not in readme and not any(part in readme for part in p.relative_to(FIXTURES).parts[:-1]
                                                       if part.startswith("audited_"))]
    assert not undescribed, undescribed
    named = set(re.findall(r"`([\w.]+\.(?:json\.gz|pickle))`", readme))
    assert named <= {p.name for p in files}, named - {p.name for p in files}


@pytest.mark.parametrize("dirname", ["traces", "snapshots", "h100/plain", "h100/audited"])
def test_each_fixture_folder_is_read_by_a_test(dirname: str) -> None:
    """A folder of recordings no test reads is weight the project need not carry."""
    last = dirname.split("/")[-1]
    readers = [f for f in (ROOT / "tests").rglob("test_*.py")
               if f"FIXTURES / \"{dirname.split('/')[0]}\"" in f.read_text() and last in f.read_text()]
    assert readers, dirname
