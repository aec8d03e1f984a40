"""The report draws each plot from real evidence: the numerics series of a run that diverges, with its
first non-finite step marked where the nonfinite rule says it is."""
from __future__ import annotations

import re

from conftest import audit


def test_numerics_plot_marks_the_first_nonfinite_step(tmp_path):
    a = audit("run", "examples/numerics_lr_blowup.py:step", "--steps", "25", "--quiet", out=tmp_path / "o")
    assert a.returncode == 0, a.stderr
    step = a.rule("nonfinite")[0]["evidence"]["first_step"]
    html = (tmp_path / "o" / "report.html").read_text()
    assert re.search(r'id="plot-\d+-numerics-plot"', html)
    assert f"first non-finite: step {step}" in html
    # a clean run still plots its series, with nothing marked
    clean = audit("run", "examples/clean.py:step", "--steps", "5", "--quiet", "--no-profile", out=tmp_path / "c")
    assert "numerics-plot" in (tmp_path / "c" / "report.html").read_text()  # loss/grad norms still drawn
    assert "first non-finite" not in (tmp_path / "c" / "report.html").read_text()
