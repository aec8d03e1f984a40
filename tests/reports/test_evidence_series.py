"""The evidence card of report.html shows a finding's per-step series as a table, not a JSON list."""
from __future__ import annotations

import re

import pytest

from conftest import FIXTURES

from auditor.cli import main

W0 = FIXTURES / "traces" / "v100_resnet50_dataloader_workers0.pt.trace.json.gz"


def test_per_step_series_is_a_table(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:  # (audit done, no --fail-on: exit 0)
        main(["analyze", str(W0), "--out", str(tmp_path), "--quiet"])
    assert done.value.code == 0, capsys.readouterr().err
    capsys.readouterr()
    html = (tmp_path / "report.html").read_text()
    # dataloader-bound's steps: one row per ProfilerStep with its columns, no raw list of records
    assert '<th>step</th><th>ms</th><th>loader (ms)</th><th>share</th>' in html
    assert "<tr><td>5</td><td>176.078</td><td>68.694</td><td>0.3901</td></tr>" in html
    assert not re.search(r'<code>\[\{&#34;step&#34;|<code>\[\{"step"', html)


def test_evidence_is_labelled_in_words_and_keeps_no_object_ids():
    """The card's labels are words with their units (the key stays as the label's title, as
    findings.json has it); names of code stay as they are; an object's id is left out of a table."""
    from auditor.reports.html import evidence_label, series_table

    assert evidence_label("median_wait_ms") == "median wait (ms)"
    assert evidence_label("steps_making_an_iterator") == "steps making an iterator"
    assert evidence_label("cpu_over_wall") == "CPU over wall"
    assert evidence_label("fp32_gflop_per_step") == "fp32 GFLOP per step"
    assert evidence_label("DataLoader.pin_memory") == "DataLoader.pin_memory"
    table = series_table([{"id": 140490372121104, "line": 12, "pin_memory": False}])
    assert table["columns"] == ["line", "pin memory"] and table["rows"] == [["12", "False"]]
