"""The report's own figures (auditor.reports.figure) are the JSON plotly's Figure makes of the same
calls, and every plot the report draws from a real audited run passes plotly's validation as it is."""
from __future__ import annotations

import json

import plotly.graph_objects as go
import plotly.io as pio
import pytest

from conftest import FIXTURES

from auditor.evidence.load import load_paths
from auditor.reports import plots
from auditor.reports.figure import Figure


def _calls(fig) -> None:
    fig.update_layout(barmode="stack", legend=dict(orientation="h", y=-0.2))
    fig.update_xaxes(title_text="ms since the window opened")
    fig.update_yaxes(type="log")
    fig.add_bar(name="allocated", x=[0, 1], y=[1.5, 2.0], marker_color="#4c78a8")
    fig.add_scatter(name="GPU allocated", x=[0.0, 1.25], y=[3.0, 4.0], mode="lines", line_shape="hv")
    fig.add_scatter(name="peak", x=[1.25], y=[4.0], mode="markers", marker=dict(symbol="star", size=12))
    fig.add_hline(y=3.5, line_dash="dash", line_color="#888", annotation_text="median 3.5 ms",
                  annotation_position="top left")
    fig.add_vline(x=1, line_dash="dash", line_color="#e45756", annotation_text="first non-finite: step 1",
                  annotation_position="top left")


def _json(fig) -> dict:
    doc = json.loads(pio.to_json(fig, validate=False, engine="json"))
    doc["layout"].pop("template", None)
    return doc


def test_the_same_calls_make_plotlys_figure():
    ours, theirs = Figure(layout=dict(title=dict(text="t"), template={})), go.Figure(layout=dict(title=dict(text="t"), template={}))
    _calls(ours)
    _calls(theirs)
    assert _json(go.Figure(ours.to_plotly_json())) == _json(theirs)
    assert ours.data[1].line.shape == "hv" and ours.layout.title.text == "t"  # read as plotly's are


@pytest.mark.parametrize("run", ["audited_gpu_convnet_clean", "audited_gpu_small_launches_clean"])
def test_every_plot_of_a_recorded_run_is_valid_plotly(run):
    ev = load_paths([FIXTURES / "h100" / "audited" / run])
    drawn = 0
    for builder in plots.PLOT_BUILDERS:
        fig = builder(ev)
        if isinstance(fig, Figure):
            go.Figure(fig.to_plotly_json())  # (raises on a property plotly does not know)
            drawn += 1
    assert drawn >= 5


def test_the_shipped_plot_template_is_plotlys():
    """templates/plotly_white.json is plotly's template, as plotly.io gives it (regenerate it with
    `json.dumps(pio.templates["plotly_white"].to_plotly_json(), separators=(",", ":"))` when plotly's
    changes), and the page reads that copy without importing plotly."""
    import subprocess
    import sys

    from auditor.reports.html import plot_template
    from auditor.reports.plots import PLOT_TEMPLATE

    assert plot_template() == pio.templates[PLOT_TEMPLATE].to_plotly_json()
    code = ("import sys; from auditor.reports.html import plot_template; plot_template(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('plotly', 'pandas')))")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert got.stdout.strip() == "[]"
