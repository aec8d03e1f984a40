"""The per-rank view of a distributed run, for reports: a table row per rank and a plotly figure.

Up to MANY_RANKS ranks the figure draws every rank; past it (a job of hundreds of ranks), the
distribution of the ranks (box plots, each point a rank named with its host on hover) and only the
outliers, the slowest ranks by their own work, beside the median rank.

Both read `auditor.evidence.ranks.view.rank_set(evidence)`, so a merged run, per-rank traces and a single rank render the
same way; the figure is None below two ranks (there is nothing to compare).
"""
from __future__ import annotations

from statistics import median
from typing import Any

from auditor.evidence import model as m
from auditor.evidence.phases import PHASES
from auditor.evidence.ranks.combine import compared_steps
from auditor.evidence.ranks.phases import COMM, PHASE_LABELS, RANK_PHASES
from auditor.evidence.ranks.scale import host_of
from auditor.evidence.ranks.view import rank_set

MANY_RANKS = 16  # past this many ranks the figure shows their distribution and the outliers
OUTLIERS = 6  # the slowest ranks drawn one by one in the figure of many ranks
BOX_POINTS = 256  # past this many ranks a box carries its figures, not every rank's value
OUTLIER_POINTS = 50  # the points outside a box's fences drawn past BOX_POINTS, the farthest first


def rank_rows(ev: m.Evidence) -> list[dict[str, Any]]:
    """One row per rank for tables: median step, busy and waiting time, phases (median ms)."""
    rs = rank_set(ev)
    if rs is None:
        return []
    cmp = compared_steps(rs)
    out = []
    for info in rs.ranks:
        steps = [r[info.rank] for r in cmp.values() if info.rank in r] or [s for s in info.steps if not s.failed]
        if not steps:
            out.append({"rank": info.rank, "host": info.hostname, "status": info.status, "steps": 0})
            continue
        step_ms = median(s.ms for s in steps)
        wait = median(s.wait_ms or 0.0 for s in steps)
        out.append({"rank": info.rank, "host": info.hostname, "status": info.status, "steps": len(info.steps),
                    "median_step_ms": round(step_ms, 3), "median_busy_ms": round(median(s.busy_ms for s in steps), 3),
                    "median_wait_ms": round(wait, 3), "wait_share": round(wait / step_ms, 4) if step_ms else None,
                    "phases_ms": {p: round(median(s.phases.get(p, 0.0) for s in steps), 3) for p in RANK_PHASES}})
    return out


_BAR_LABELS = {**PHASE_LABELS, "transfer": "transfer (in collectives)", "waiting": "waiting for other ranks"}
_PHASE_COLORS = {"data": "#4c78a8", "forward": "#72b7b2", "backward": "#54a24b", "optimizer": "#eeca3b",
                 "sync": "#e45756", "cleanup": "#b279a2", "other": "#bab0ac", "transfer": "#9d755d",
                 "waiting": "#ff9da6"}


def rank_figure(ev: m.Evidence) -> Any | None:
    """(evidence) -> plotly Figure | None: step time per rank and step, where each rank spent its
    step (median ms per phase, communication split into transfer and waiting), and the time each
    rank waited for the others in each step. None when the evidence holds fewer than two ranks."""
    rs = rank_set(ev)
    if rs is None or len(rs.ranks) < 2:
        return None
    if len(rs.ranks) > MANY_RANKS:
        return _many_ranks_figure(ev, rs)
    import plotly.graph_objects as go
    from plotly.colors import qualitative
    from plotly.subplots import make_subplots

    palette = qualitative.Dark24
    fig = make_subplots(rows=3, cols=1, vertical_spacing=0.13,
                        subplot_titles=("Step time per rank (ms)", "Where each rank spent its step (median ms)",
                                        "Waiting for other ranks in collectives (ms)"))
    for info in rs.ranks:
        ok = [s for s in info.steps if not s.failed]
        line = {"color": palette[info.rank % len(palette)]}
        fig.add_trace(go.Scatter(x=[s.index for s in ok], y=[round(s.ms, 2) for s in ok], mode="lines+markers",
                                 name=f"rank {info.rank}", legendgroup=f"rank {info.rank}", line=line), row=1, col=1)
        fig.add_trace(go.Scatter(x=[s.index for s in ok], y=[round(s.wait_ms or 0.0, 2) for s in ok],
                                 mode="lines+markers", name=f"rank {info.rank}", legendgroup=f"rank {info.rank}",
                                 line=line, showlegend=False), row=3, col=1)
    rows = [r for r in rank_rows(ev) if r.get("phases_ms")]
    labels = [f"rank {r['rank']}" for r in rows]
    for phase in (*PHASES, "transfer", "waiting"):
        if phase == "transfer":
            values = [max(0.0, r["phases_ms"][COMM] - r["median_wait_ms"]) for r in rows]
        elif phase == "waiting":
            values = [r["median_wait_ms"] for r in rows]
        else:
            values = [r["phases_ms"].get(phase, 0.0) for r in rows]
        if any(values):
            fig.add_trace(go.Bar(y=labels, x=values, orientation="h", name=_BAR_LABELS.get(phase, phase),
                                 marker_color=_PHASE_COLORS[phase]), row=2, col=1)
    fig.update_layout(barmode="stack", height=760, margin={"l": 60, "r": 20, "t": 40, "b": 30},
                      legend={"orientation": "h"})
    fig.update_xaxes(title_text="step", row=3, col=1)
    return fig


def outlier_ranks(rows: list[dict[str, Any]], limit: int = OUTLIERS) -> list[int]:
    """The ranks slowest by their own work (median step minus communication), slowest first: those
    past the upper Tukey fence (p75 + 1.5 x IQR), or the slowest few when none is."""
    work = sorted(((r["median_step_ms"] - r["phases_ms"].get(COMM, 0.0), r["rank"]) for r in rows), reverse=True)
    if not work:
        return []
    xs = sorted(w for w, _ in work)
    q1, q3 = xs[len(xs) // 4], xs[(3 * len(xs)) // 4]
    fence = q3 + 1.5 * (q3 - q1)
    past = [r for w, r in work if w > fence]
    return (past or [r for _, r in work[:3]])[:limit]


def _distribution(go: Any, name: str, values: list[float], labels: list[str]) -> list[Any]:
    """A box of the ranks' `values`. Up to BOX_POINTS ranks, plotly's own box of every point (its
    outliers drawn); past it, the box's figures computed here (quartiles as plotly's linear method,
    Tukey's fences at the last values within 1.5 x IQR) and the OUTLIER_POINTS points farthest
    outside them drawn, so the page does not carry a value per rank (2,000 ranks: 180 KB)."""
    hover = "%{text}: %{x:.2f} ms<extra></extra>"
    if len(values) <= BOX_POINTS:
        return [go.Box(x=values, name=name, text=labels, boxpoints="outliers", orientation="h",
                       hovertemplate=hover, showlegend=False)]
    import numpy as np

    xs = np.asarray(values, dtype=float)
    q1, mid, q3 = (float(v) for v in np.percentile(xs, [25, 50, 75]))
    lo, hi = q1 - 1.5 * (q3 - q1), q3 + 1.5 * (q3 - q1)
    inside = xs[(xs >= lo) & (xs <= hi)]
    outside = sorted((i for i in range(len(xs)) if not lo <= xs[i] <= hi),
                     key=lambda i: -abs(xs[i] - mid))[:OUTLIER_POINTS]
    box = go.Box(y=[name], q1=[q1], median=[mid], q3=[q3], lowerfence=[float(inside.min())],
                 upperfence=[float(inside.max())], orientation="h", name=name, showlegend=False,
                 hoverinfo="x")
    points = go.Scatter(x=[round(float(xs[i]), 3) for i in outside], y=[name] * len(outside), mode="markers",
                        text=[labels[i] for i in outside], hovertemplate=hover, showlegend=False,
                        marker={"size": 4})
    return [box, points]


def _many_ranks_figure(ev: m.Evidence, rs) -> Any:
    """The figure for many ranks: distributions, the outliers' phases beside the median rank's, and
    step times of the outliers against the band every rank's steps fall in."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = [r for r in rank_rows(ev) if r.get("phases_ms")]
    outliers = outlier_ranks(rows)
    fig = make_subplots(rows=3, cols=1, vertical_spacing=0.12,
                        subplot_titles=(f"Distribution over the {len(rs.ranks)} ranks (median ms per step; a point "
                                        f"is a rank)",
                                        "Where the slowest ranks spent their step, beside the median rank (ms)",
                                        "Step time: every rank's range and median, the slowest ranks (ms)"))
    labels = [f"rank {r['rank']} ({host_of(rs.get(r['rank']))})" for r in rows]
    for name, values in (("step", [r["median_step_ms"] for r in rows]),
                         ("own work", [r["median_step_ms"] - r["phases_ms"].get(COMM, 0.0) for r in rows]),
                         ("waiting", [r["median_wait_ms"] for r in rows])):
        for trace in _distribution(go, name, values, labels):
            fig.add_trace(trace, row=1, col=1)
    by_rank = {r["rank"]: r for r in rows}
    median_row = {"rank": "median", "phases_ms": {p: median(r["phases_ms"].get(p, 0.0) for r in rows)
                                                  for p in RANK_PHASES},
                  "median_wait_ms": median(r["median_wait_ms"] for r in rows)}
    shown = [by_rank[r] for r in outliers] + [median_row]
    names = [f"rank {r['rank']} ({host_of(rs.get(r['rank']))})" if r["rank"] != "median" else "median rank"
             for r in shown]
    for phase in (*PHASES, "transfer", "waiting"):
        if phase == "transfer":
            values = [max(0.0, r["phases_ms"][COMM] - r["median_wait_ms"]) for r in shown]
        elif phase == "waiting":
            values = [r["median_wait_ms"] for r in shown]
        else:
            values = [r["phases_ms"].get(phase, 0.0) for r in shown]
        if any(values):
            fig.add_trace(go.Bar(y=names, x=values, orientation="h", name=_BAR_LABELS.get(phase, phase),
                                 marker_color=_PHASE_COLORS[phase]), row=2, col=1)
    per_step: dict[int, list[float]] = {}
    for info in rs.ranks:
        for st in info.steps:
            if not st.failed:
                per_step.setdefault(st.index, []).append(st.ms)
    xs = sorted(per_step)
    band = dict(mode="lines", line={"width": 0}, showlegend=False, hoverinfo="skip")
    fig.add_trace(go.Scatter(x=xs, y=[min(per_step[i]) for i in xs], **band), row=3, col=1)
    fig.add_trace(go.Scatter(x=xs, y=[max(per_step[i]) for i in xs], fill="tonexty", fillcolor="rgba(150,150,150,0.3)",
                             name="all ranks (min-max)", mode="lines", line={"width": 0}), row=3, col=1)
    fig.add_trace(go.Scatter(x=xs, y=[round(median(per_step[i]), 2) for i in xs], name="median rank",
                             mode="lines+markers", line={"color": "#555"}), row=3, col=1)
    for r in outliers:
        info = rs.get(r)
        ok = [st for st in info.steps if not st.failed] if info else []
        fig.add_trace(go.Scatter(x=[st.index for st in ok], y=[round(st.ms, 2) for st in ok], mode="lines+markers",
                                 name=f"rank {r} ({host_of(info)})"), row=3, col=1)
    fig.update_layout(barmode="stack", height=820, margin={"l": 60, "r": 20, "t": 40, "b": 30},
                      legend={"orientation": "h"})
    fig.update_xaxes(title_text="step", row=3, col=1)
    return fig
