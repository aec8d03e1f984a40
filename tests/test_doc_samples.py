"""The outputs the README and the docs show are what today's code prints: each audit sample is
re-rendered from the run it was made from (kept in tests/fixtures/docs by docs/samples.py), each sample
of a recorded trace is run again. A change of the terminal's format fails here until
`python docs/samples.py` makes the samples again."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

import pytest

from conftest import FIXTURES, ROOT

_spec = importlib.util.spec_from_file_location("doc_samples", ROOT / "docs" / "samples.py")
samples = sys.modules["doc_samples"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(samples)


def _audit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "auditor", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def rerendered(tmp_path_factory) -> dict[str, list[str]]:
    """Each kept audit's summary as `audit report` prints it today, its directory's name as RUN."""
    out = {}
    for s in samples.AUDITS:
        run = tmp_path_factory.mktemp("doc") / s.name
        shutil.copytree(FIXTURES / "docs" / s.name, run)
        done = subprocess.run(samples.report_command(run), cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        out[s.name] = samples.comparable(done.stdout.splitlines(), str(run))
    return out


@pytest.mark.parametrize("sample,page", [(s, p) for s in samples.AUDITS for p in s.pages],
                         ids=lambda v: getattr(v, "name", v))
def test_an_audits_sample_output_is_what_its_run_prints_today(rerendered, sample, page):
    _, shown = samples.block(ROOT / page, sample.command)
    assert samples.comparable(shown, "") == rerendered[sample.name]


def test_a_changed_summary_line_fails_the_check(rerendered):
    """The comparison can fail: one figure changed in the page's copy is a difference."""
    s = samples.AUDITS[0]
    _, shown = samples.block(ROOT / s.pages[0], s.command)
    changed = [line.replace("median ", "median 1", 1) for line in shown]
    assert samples.comparable(changed, "") != rerendered[s.name]


def test_the_diff_of_two_recorded_traces_prints_what_the_page_shows(tmp_path):
    """docs/diff-and-ci.md's `audit diff` of the two ResNet-50 recordings: every line it shows (its
    `...` stands for rows left out) is printed today, in that order."""
    command = ("audit diff v100_resnet50_dataloader_workers0.pt.trace.json.gz "
               "v100_resnet50_dataloader_workers4.pt.trace.json.gz")
    _, shown = samples.block(ROOT / "docs" / "diff-and-ci.md", command)
    traces = FIXTURES / "traces"
    done = _audit("diff", str(traces / command.split()[2]), str(traces / command.split()[3]),
                  "--out", str(tmp_path / "diff"))
    assert done.returncode == 0, done.stderr
    printed = iter(line.rstrip() for line in done.stdout.splitlines())
    for line in (s.rstrip() for s in shown if s.strip() != "..."):
        assert any(p == line for p in printed), f"not printed (or out of order): {line}"
