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
    assert '<th>step</th><th>ms</th><th>loader_ms</th><th>share</th>' in html
    assert "<tr><td>5</td><td>176.078</td><td>68.694</td><td>0.3901</td></tr>" in html
    assert not re.search(r'<code>\[\{&#34;step&#34;|<code>\[\{"step"', html)
