"""The report's plots: each a function of the evidence returning a figure (auditor.reports.figure's,
plain plotly JSON; or a plotly Figure), or None when the evidence it needs is absent.
`PLOT_BUILDERS` is the order they appear in."""
from __future__ import annotations

import math

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from auditor.evidence.model import Evidence
from auditor.evidence.numerics_view import NumericsView
from auditor.evidence.phases import PHASES, phase_table
from auditor.reports.figure import Figure
from auditor.reports.gpu_plots import kernel_group_plot, roofline_plot
from auditor.reports.rank_plots import rank_figure

if TYPE_CHECKING:
    import plotly.graph_objects as go

PlotBuilder = Callable[[Evidence], "Figure | go.Figure | None"]
MiB = 2**20
MAX_LINE_POINTS = 1000  # per line in a plot (about one per pixel of its width; decimate keeps the extremes): the report stays under 5 MB whatever the run's length
PLOT_TEMPLATE = "plotly_white"  # the page applies it once to every plot (see html.build_plots)

_PHASE_COLORS = {"data": "#8c6bb1", "forward": "#4c78a8", "backward": "#f58518", "optimizer": "#54a24b",
                 "sync": "#e45756", "cleanup": "#72b7b2", "other": "#bab0ac"}


def _layout(title: str, y_title: str) -> dict[str, Any]:
    # template={}: no per-figure copy of a plotly template (~50 ms each); the page applies
    # PLOT_TEMPLATE to every plot
    return dict(title=dict(text=title), xaxis=dict(title=dict(text="step")), yaxis=dict(title=dict(text=y_title)),
                margin=dict(l=60, r=20, t=50, b=50), height=360, template={},
                legend=dict(orientation="h", y=-0.2, traceorder="normal"))


def phase_plot(ev: Evidence) -> Figure | None:
    """Where each step's time went: stacked phases, from the probes' timed tallies."""
    rows = phase_table(ev)
    if not rows:
        return None
    fig = Figure(layout=_layout("Step time by phase (ms)", "ms"))
    keep = decimate(np.array([sum(r[p] for p in PHASES) for r in rows], dtype=float), MAX_LINE_POINTS)
    rows = [rows[k] for k in keep]
    steps = [r["step"] for r in rows]
    for phase in PHASES:
        ys = [round(r[phase], 3) for r in rows]
        if phase == "other" or any(ys):
            fig.add_bar(name=phase, x=steps, y=ys, marker_color=_PHASE_COLORS[phase])
    fig.update_layout(barmode="stack")
    return fig


def step_time_plot(ev: Evidence) -> Figure | None:
    """Step wall time over the run; profiled steps are marked (the profiler slows them). For
    recordings analysed on their own, the steps the reports state (a trace's ProfilerSteps, or the
    iterations of one recorded without a schedule)."""
    if not ev.steps:
        return recorded_step_plot(ev)
    fig = Figure(layout=_layout("Step time over the run (ms)", "ms"))
    shown = [ev.steps[k] for k in decimate(np.array([s.time_ms for s in ev.steps], dtype=float), MAX_LINE_POINTS)]
    clocked = any(s.device_ms is not None for s in ev.steps)
    fig.add_scatter(name="step (host clock)" if clocked else "step", x=[s.index for s in shown],
                    y=[round(s.ms, 3) for s in shown], mode="lines+markers", line=dict(color="#4c78a8"))
    if clocked:  # (the device's clock of each step: the step is the longer of the two)
        fig.add_scatter(name="step (device clock)", x=[s.index for s in shown if s.device_ms is not None],
                        y=[round(s.device_ms, 3) for s in shown if s.device_ms is not None],
                        mode="lines+markers", line=dict(color="#f58518"))
    # each step's role (auditor.capture.numerics.schedule): the median is of the timed steps only
    prof = [s for s in ev.steps if s.profiled]
    if prof:
        fig.add_scatter(name="profiled step", x=[s.index for s in prof], y=[round(s.time_ms, 3) for s in prof],
                        mode="markers", marker=dict(symbol="diamond-open", size=12, color="#e45756"))
    timed = ev.timed_steps()
    checked = [s for s in ev.steps if not s.profiled and s.numerics is not None]
    if checked and len(ev.steps) <= MAX_LINE_POINTS:
        fig.add_scatter(name="checked step (numerics checks)", x=[s.index for s in checked],
                        y=[round(s.time_ms, 3) for s in checked], mode="markers",
                        marker=dict(symbol="square-open", size=9, color="#9d755d"))
    median = ev.median_step_ms()
    if median is not None:
        of = f" of the {len(timed)} timed steps" if checked and timed else ""
        fig.add_hline(y=median, line_dash="dash", line_color="#888",
                      annotation_text=f"median{of} {median:.1f} ms", annotation_position="top left")
    _whole_steps(fig, len(ev.steps))
    return fig


def log_ticks(values: list[float], most: int = 8) -> dict[str, Any]:
    """Labelled ticks for a log axis over `values`: the 1-2-5 steps of each decade the values span,
    thinned to 1 a decade (then every other decade) when there would be more than `most`; plotly's
    own labels every minor tick of a short range (6, 7, 8, 9, 0.1, ...), which overlap."""
    values = [v for v in values if v > 0]
    if not values:
        return {}
    lo, hi = min(values), max(values)
    first, last = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    for mantissas, every in (((1, 2, 5), 1), ((1,), 1), ((1,), 2), ((1,), 4)):
        ticks = [m * 10.0 ** k for k in range(first, last + 1, every) for m in mantissas]
        inside = [v for v in ticks if lo / 1.05 <= v <= hi * 1.05]
        if len(inside) <= most:
            break
    if len(inside) < 2:  # a range inside one 1-2-5 step: its ends, to two figures
        inside = sorted({float(f"{lo:.2g}"), float(f"{hi:.2g}")})
    return dict(tickmode="array", tickvals=inside, ticktext=[f"{v:g}" for v in inside])


def _whole_steps(fig: Figure, n: int) -> None:
    """Steps are counted: no tick between two of them (a 6-step run would get 0.5, 1.5)."""
    fig.update_xaxes(tickformat="d")
    if n <= 100:
        fig.update_xaxes(dtick=max(1, -(-n // 10)))


def recorded_step_plot(ev: Evidence) -> Figure | None:
    """The shown trace's steps (Evidence.shown_trace), by their ProfilerStep number, median marked."""
    trace = ev.shown_trace()
    if trace is None:
        return None
    steps = trace.steps
    what = "ProfilerStep" if trace.steps_from is None else "iteration"
    fig = Figure(layout=_layout(f"Step time in {trace.label} (ms)", "ms"))
    fig.update_xaxes(title_text=what if what == "ProfilerStep" else "iteration (no ProfilerSteps recorded)")
    fig.add_scatter(name=what, x=steps["step"].tolist(), y=(steps["dur"].to_numpy() / 1e3).round(3).tolist(),
                    mode="lines+markers", line=dict(color="#4c78a8"))
    _whole_steps(fig, len(steps))
    device = trace.device_step_ms()
    if np.isfinite(device).any() and trace.median_step_ms() > float(np.median(trace.host_step_ms())):
        known = np.isfinite(device)  # (device-bound: the device's work per step is the step)
        fig.add_scatter(name="device work", x=steps["step"][known].tolist(), y=device[known].round(3).tolist(),
                        mode="lines+markers", line=dict(color="#f58518"))
    median = trace.median_step_ms()
    fig.add_hline(y=median, line_dash="dash", line_color="#888", annotation_text=f"median {median:.1f} ms",
                  annotation_position="top left")
    return fig


def memory_plot(ev: Evidence) -> Figure | None:
    """Memory at each step boundary: process RSS and, on a real device, the CUDA allocator."""
    series = {"process RSS": [s.rss_bytes for s in ev.steps],
              "device allocated": [s.device_allocated for s in ev.steps],
              "device reserved": [s.device_reserved for s in ev.steps]}
    series = {k: v for k, v in series.items() if any(x is not None for x in v)}
    if not series:
        return None
    fig = Figure(layout=_layout("Memory at step end (MiB)", "MiB"))
    for name, values in series.items():
        keep = decimate(np.array([v if v is not None else np.nan for v in values], dtype=float), MAX_LINE_POINTS)
        fig.add_scatter(name=name, x=[ev.steps[k].index for k in keep],
                        y=[round(values[k] / 2**20, 2) if values[k] is not None else None for k in keep],
                        mode="lines+markers")
    return fig






def memory_timeline_plot(ev: Evidence) -> Figure | None:
    """Allocated memory through the profiled window, from the trace's `[memory]` events, peak marked."""
    fig = None
    for trace in ev.trace_data:
        mem = trace.of("memory", columns=["ts", "device_type", "total_allocated", "bytes"])
        if mem.empty:
            continue
        if fig is None:
            fig = Figure(layout=_layout("Memory in the profiled window (MiB)", "MiB"))
            fig.update_xaxes(title_text="ms since the window opened")
        t0 = float(mem["ts"].min())
        for dev, part in mem.groupby("device_type"):
            ms = (part["ts"].to_numpy() - t0) / 1e3
            label = {0: "CPU allocated", 1: "GPU allocated"}.get(int(dev), f"device type {int(dev)} allocated")
            total = part["total_allocated"].to_numpy()
            if (total >= 0).any():
                mib = np.where(total >= 0, total, 0) / MiB
                peak_text = "peak {:.1f} MiB"
            else:  # older Kineto records only each allocation's size (Bytes, negative when freed)
                mib = np.cumsum(part["bytes"].to_numpy()) / MiB
                label += " (change since the window opened)"
                peak_text = "peak {:+.1f} MiB"
            if not np.abs(mib).max() > 0.05:  # nothing allocated to show (a CPU run's zeros): no line
                continue
            peak = int(mib.argmax())
            keep = decimate(mib, MAX_LINE_POINTS)
            fig.add_scatter(name=label, x=ms[keep].round(3).tolist(), y=mib[keep].round(3).tolist(), mode="lines",
                            line_shape="hv")
            fig.add_scatter(name=peak_text.format(mib[peak]), x=[round(float(ms[peak]), 3)],
                            y=[round(float(mib[peak]), 3)], mode="markers",
                            marker=dict(symbol="star", size=12, color="#e45756"))
    return fig if fig is not None and fig.data else None


def decimate(y: np.ndarray, max_points: int) -> np.ndarray:
    """Indexes of at most ~max_points samples of y that keep its shape: the first and last, and the
    minimum and maximum of each of max_points / 2 equal slices (so every peak survives). A trace's
    `[memory]` series runs to millions of points, a long run's per-step series to tens of
    thousands, which would make the report tens of MB. A missing value (NaN) counts as the series'
    minimum."""
    n = len(y)
    if n <= max_points:
        return np.arange(n)
    if np.isnan(y).any():
        y = np.where(np.isnan(y), np.nanmin(y) if not np.isnan(y).all() else 0.0, y)
    edges = np.linspace(0, n, max_points // 2 + 1).astype(np.int64)
    starts = edges[:-1]
    bucket = np.repeat(np.arange(len(starts)), np.diff(edges))
    picks = [np.array([0, n - 1])]
    for extreme in (np.maximum, np.minimum):
        hit = np.flatnonzero(y == extreme.reduceat(y, starts)[bucket])
        picks.append(hit[np.unique(bucket[hit], return_index=True)[1]])
    return np.unique(np.concatenate(picks))


def segment_map_plot(ev: Evidence) -> Figure | None:
    """A CUDA memory snapshot's segments by address: allocated vs free bytes in each (fragmentation)."""
    fig = None
    for snap in ev.snapshot_data:
        segs = sorted(snap.segments, key=lambda s: (s.device, s.address))
        if not segs:
            continue
        if fig is None:
            fig = Figure(layout=_layout("Allocator segments by address (MiB)", "MiB"))
            fig.update_xaxes(title_text="segment (by address)")
            fig.update_layout(barmode="stack")
        x = list(range(len(segs)))
        fig.add_bar(name="allocated", x=x, y=[round(s.allocated_size / MiB, 2) for s in segs], marker_color="#4c78a8")
        fig.add_bar(name="free inside segment", x=x, y=[round((s.total_size - s.allocated_size) / MiB, 2) for s in segs],
                    marker_color="#e45756")
    return fig


def numerics_plot(ev: Evidence) -> Figure | None:
    """Loss and global gradient norm per step (log scale), the first non-finite step marked."""
    view = NumericsView.of(ev)
    loss, norms = view.loss_series(), view.grad_norm_series()
    if not loss and not norms:
        return None

    def finite(series: list[list]) -> tuple[list, list]:
        pts = [(i, v) for i, v in series if isinstance(v, (int, float)) and math.isfinite(v) and v > 0]
        pts = [pts[k] for k in decimate(np.array([v for _, v in pts], dtype=float), MAX_LINE_POINTS)]
        return [i for i, _ in pts], [v for _, v in pts]

    drawn = {name: finite(series) for name, series in (("loss", loss), ("gradient norm", norms))}
    steps = sorted({i for x, _ in drawn.values() for i in x})
    # the values are those of the steps the numerics checks ran on (the first ones, then one in 32,
    # fewer in a long run: numerics.schedule): the title says so, and the x axis spans the whole
    # run so that where they stop shows
    n = len(ev.steps)
    of = f", the {len(steps)} checked steps of {n}" if steps and n > len(steps) else ""
    fig = Figure(layout=_layout(f"Loss and gradient norm (log scale{of})", "value"))
    fig.update_yaxes(type="log", **log_ticks([v for _, y in drawn.values() for v in y]))
    for name, (x, y) in drawn.items():
        if x:
            fig.add_scatter(name=name, x=x, y=y, mode="lines+markers")
    if n:
        fig.update_xaxes(range=[ev.steps[0].index - 0.5, ev.steps[-1].index + 0.5])
        _whole_steps(fig, n)
    # The step where the run went bad (what nonfinite names): a non-finite loss, gradient or weight,
    # or a traced origin; not a step whose only non-finite values are by design (a mask's -inf).
    bad = [i for i, d in view.steps if d.origin is not None or d.loss_finite is False
           or any(r.grad_nonfinite or r.param_nonfinite for r in d.opt_steps)]
    if bad:
        fig.add_vline(x=bad[0], line_dash="dash", line_color="#e45756",
                      annotation_text=f"first non-finite: step {bad[0]}", annotation_position="top left")
    return fig


PLOT_BUILDERS: list[PlotBuilder] = [phase_plot, step_time_plot, memory_plot, numerics_plot, rank_figure,
                                    memory_timeline_plot, segment_map_plot, kernel_group_plot, roofline_plot]
