"""A plotly figure built as the plain JSON plotly.js draws: the part of plotly's `Figure` API the
report's own plots use (`add_scatter`, `add_bar`, `update_layout`, `update_xaxes`, `update_yaxes`,
`add_hline`, `add_vline`), with plotly's property names and its magic underscores
(`marker_color=` is `marker={"color": ...}`).

plotly's own Figure validates every property as it is set: about a quarter of a second a report,
most of what writing the report costs after a short audit. These figures are checked by plotly.js
in the page instead. Plots that need more of plotly (subplots, box plots) still build plotly
Figures; the page takes either.
"""
from __future__ import annotations

from typing import Any


class Props(dict):
    """Properties, read as keys or as attributes (`fig.data[0].y`, `fig.layout.title.text`), as
    plotly's objects read."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _props(value: Any) -> Any:
    if isinstance(value, dict):
        return Props({k: _props(v) for k, v in value.items()})
    return value


def _merge(into: Props, props: dict[str, Any]) -> None:
    """Set `props` in `into`, splitting magic underscores (`title_text`: title.text) and merging
    nested dicts key by key, as plotly's update methods do."""
    for key, value in props.items():
        *path, last = key.split("_")
        at = into
        for part in path:
            at = at.setdefault(part, Props())
        if isinstance(value, dict) and isinstance(at.get(last), dict):
            _merge(at[last], value)
        else:
            at[last] = _props(value)


class Figure:
    """`data` (traces) and `layout`, as plotly's Figure holds them; `to_plotly_json()` is the
    figure the page draws."""

    def __init__(self, layout: dict[str, Any] | None = None) -> None:
        self.data: list[Props] = []
        self.layout = Props()
        _merge(self.layout, layout or {})

    def _add(self, kind: str, props: dict[str, Any]) -> None:
        trace = Props()
        _merge(trace, props)
        trace["type"] = kind
        self.data.append(trace)

    def add_scatter(self, **props: Any) -> None:
        self._add("scatter", props)

    def add_bar(self, **props: Any) -> None:
        self._add("bar", props)

    def update_layout(self, **props: Any) -> None:
        _merge(self.layout, props)

    def update_xaxes(self, **props: Any) -> None:
        _merge(self.layout.setdefault("xaxis", Props()), props)

    def update_yaxes(self, **props: Any) -> None:
        _merge(self.layout.setdefault("yaxis", Props()), props)

    def add_hline(self, y: float, line_dash: str | None = None, line_color: str | None = None,
                  annotation_text: str | None = None, annotation_position: str = "top left") -> None:
        """A horizontal line across the plot at `y`, labelled at its left end (plotly's own shape
        and annotation for `add_hline(..., annotation_position="top left")`)."""
        self._line(dict(x0=0, x1=1, xref="x domain", y0=y, y1=y, yref="y"), line_dash, line_color)
        if annotation_text is not None:
            self._note(annotation_position, dict(text=annotation_text, x=0, xanchor="left", xref="x domain",
                                                 y=y, yanchor="bottom", yref="y"))

    def add_vline(self, x: float, line_dash: str | None = None, line_color: str | None = None,
                  annotation_text: str | None = None, annotation_position: str = "top left") -> None:
        """A vertical line up the plot at `x`, labelled at its top, to its left."""
        self._line(dict(x0=x, x1=x, xref="x", y0=0, y1=1, yref="y domain"), line_dash, line_color)
        if annotation_text is not None:
            self._note(annotation_position, dict(text=annotation_text, x=x, xanchor="right", xref="x",
                                                 y=1, yanchor="top", yref="y domain"))

    def _line(self, where: dict[str, Any], dash: str | None, color: str | None) -> None:
        line = {k: v for k, v in (("color", color), ("dash", dash)) if v is not None}
        self.layout.setdefault("shapes", []).append(_props({"type": "line", **where, "line": line}))

    def _note(self, position: str, note: dict[str, Any]) -> None:
        if position != "top left":
            raise ValueError(f"annotation_position {position!r}: only 'top left' is drawn here")
        self.layout.setdefault("annotations", []).append(_props({"showarrow": False, **note}))

    def to_plotly_json(self) -> dict[str, Any]:
        return {"data": self.data, "layout": self.layout}
