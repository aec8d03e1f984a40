"""report.html's first screen on README command 1's kept run (tests/fixtures/docs/audited_train_script,
a CUDA rehearsal on a CPU): one sentence that its GPU figures are predictions, a bar of the run's time
split into its parts with each warning's saving under it, then the findings as one-liners that open to
their detail, the cost as numbers."""
from __future__ import annotations

import html
import re
import shutil

import pytest

from conftest import FIXTURES

from auditor.config import Config
from auditor.evidence.load import load_paths
from auditor.reports.base import detail_of, first_sentence
from auditor.reports.html import HtmlReport
from auditor.rules.engine import run_rules


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    run = tmp_path_factory.mktemp("first") / "audited_train_script"
    shutil.copytree(FIXTURES / "docs" / "audited_train_script", run)
    evidence = load_paths([run])
    results = run_rules(evidence, Config())
    doc = {"findings": results.findings}
    return HtmlReport().render(evidence, results, run), doc


def test_a_rehearsal_says_at_the_top_its_gpu_figures_are_predictions(page):
    text, _ = page
    said = re.search(r'<p class="rehearsed" id="rehearsed">([^<]*)</p>', text)[1]
    assert said == ("This CUDA program was rehearsed on this machine's CPU: its GPU figures are predictions for "
                    "an NVIDIA A100 SXM4 80GB, not measurements.")
    assert text.index('id="rehearsed"') < text.index('id="verdict"')


def test_the_run_time_bar_comes_before_the_findings(page):
    text, doc = page
    bar = text[text.index('<section id="time"'):text.index('<section id="findings">')]
    parts = re.findall(r'class="part part-(\w+)" style="width: ([\d.]+)%"', bar)
    assert [p for p, _ in parts] == ["work", "data"]  # (syncs, 0.02 ms of 35.0: listed, not drawn)
    assert sum(float(w) for _, w in parts) == pytest.approx(100 * (19.4 + 15.5) / 35.0, abs=0.5)
    savings = re.findall(r'<a class="saving" href="#(finding-\d+)" style="width: ([\d.]+)%" title="([\w-]+):', bar)
    loader = next(i for i, f in enumerate(doc["findings"]) if f.rule == "dataloader-bound")
    assert savings[0][0] == f"finding-{loader + 1}" and savings[0][2] == "dataloader-bound"
    assert float(savings[0][1]) == pytest.approx(100 * doc["findings"][loader].cost.ms_per_step / 35.0, abs=0.2)
    assert "syncs 0.02 ms" in bar and "pageable-copy &minus;0.32 ms" in bar
    assert text.index('id="time"') < text.index('id="findings"') < text.index('id="clocks"')


def test_the_findings_table_holds_one_line_and_numbers(page):
    text, doc = page
    table = text[text.index('<table class="ranked">'):text.index("</table>", text.index('<table class="ranked">'))]
    rows = re.findall(r"<tr>(.*?)</tr>", table, re.S)[1:]
    assert len(rows) == len(doc["findings"]) == 5
    for row, f in zip(rows, doc["findings"]):
        summary = re.search(r"<summary>(.*?)</summary><p>(.*?)</p>", row, re.S)
        assert html.unescape(summary[1]) == first_sentence(f.message) and html.unescape(summary[2]) == detail_of(f.message)
        cost = html.unescape(re.search(r'<td class="cost">([^<]*)</td>', row)[1])
        if f.cost.ms_per_step is None:
            assert cost == "counted"
        else:
            assert re.fullmatch(r"[\d.]+ ms/step, \d+%(, estimated)?", cost), cost
    assert "<summary>Steps wait for data: load it in DataLoader workers.</summary>" in rows[0]
    assert re.search(r'<td class="cost">15\.4 ms/step, 44%</td>', rows[0])
