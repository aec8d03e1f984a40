"""The report's GPU efficiency plots (auditor.evidence.trace.efficiency): time per kernel group, and
the roofline (achieved TFLOP/s of each operator and shape against its arithmetic intensity, under
the device model's memory and compute roofs). Each returns None when the evidence has no trace
with GPU work (the roofline also when the trace records no shapes)."""
from __future__ import annotations

import numpy as np

from auditor.evidence.model import Evidence
from auditor.evidence.trace.efficiency import efficiency, gpu_trace
from auditor.reports.figure import Figure

MAX_POINTS = 60  # operators on the roofline, by kernel time: the rest are a sliver of it
_GROUP_COLORS = {"communication": "#e45756", "attention": "#54a24b", "softmax": "#f58518", "gemm": "#4c78a8",
                 "conv": "#72b7b2", "norm": "#b279a2", "elementwise": "#ff9da6", "reduce": "#9d755d",
                 "memcpy": "#bab0ac", "memset": "#d8d8d8", "other": "#888888"}


def kernel_group_plot(ev: Evidence) -> Figure | None:
    """GPU time per step in each kernel group, largest first."""
    trace = gpu_trace(ev)
    if trace is None:
        return None
    eff = efficiency(trace, ev.environment.device_model)
    if not eff.groups:
        return None
    steps = trace.step_count()
    groups = list(reversed(eff.groups))  # (a horizontal bar chart draws the first at the bottom)
    fig = Figure(layout=dict(title=dict(text=f"GPU time per step by kernel group ({trace.label})"),
                                xaxis=dict(title=dict(text="ms per step")), margin=dict(l=110, r=20, t=50, b=50),
                                height=max(240, 40 + 28 * len(groups)), template={}, showlegend=False))
    fig.add_bar(orientation="h", y=[g.group for g in groups], x=[round(g.ms / steps, 3) for g in groups],
                marker_color=[_GROUP_COLORS.get(g.group, "#888888") for g in groups],
                text=[f"{g.share:.0%}" + (f", {g.tflops:.1f} TFLOP/s" if g.tflops else "") for g in groups],
                textposition="auto", hovertemplate="%{y}: %{x:.3f} ms/step (%{text})<extra></extra>")
    return fig


def roofline_plot(ev: Evidence) -> Figure | None:
    """Each operator and shape at (FLOP per byte, achieved TFLOP/s), log-log, marker size by kernel
    time, under the device's roofs (memory bandwidth up to the ridge point, then the peak) for
    bf16/fp16 and fp32."""
    trace = gpu_trace(ev)
    if trace is None:
        return None
    eff = efficiency(trace, ev.environment.device_model)
    ops = [o for o in eff.ops if o.tflops and o.intensity][:MAX_POINTS]
    if not ops:
        return None
    device = eff.device
    title = f"Roofline on {device.name}" if device else "Achieved TFLOP/s by arithmetic intensity (no device known)"
    fig = Figure(layout=dict(title=dict(text=title), template={}, height=420, margin=dict(l=60, r=20, t=50, b=50),
                                xaxis=dict(type="log", title=dict(text="arithmetic intensity (FLOP/byte)")),
                                yaxis=dict(type="log", title=dict(text="achieved TFLOP/s")),
                                legend=dict(orientation="h", y=-0.2)))
    lo = min(o.intensity for o in ops) / 2
    hi = max(o.intensity for o in ops) * 2
    if device is not None:
        hi = max(hi, device.ridge * 4)
        x = np.geomspace(lo, hi, 80)
        for label, peak in (("bf16/fp16 roof", device.bf16), ("fp32 roof", device.fp32)):
            y = np.minimum(peak, x * device.mem_bw_gbs / 1e3)
            fig.add_scatter(name=label, x=x.tolist(), y=y.round(4).tolist(), mode="lines",
                            line=dict(dash="dash" if "fp32" in label else "solid", color="#555"), hoverinfo="skip")
    by_kind: dict[str, list] = {}
    for o in ops:
        by_kind.setdefault(o.kind, []).append(o)
    top_ms = max(o.kernel_ms for o in ops)
    for kind, rows in by_kind.items():
        fig.add_scatter(name=kind, mode="markers", x=[o.intensity for o in rows], y=[o.tflops for o in rows],
                        marker=dict(size=[8 + 30 * (o.kernel_ms / top_ms) ** 0.5 for o in rows], opacity=0.75),
                        text=[f"{o.op} [{o.shapes}] {o.dtype}<br>{o.count} calls, {o.kernel_ms:.2f} ms, "
                              f"{o.tflops:.1f} TFLOP/s, {o.tbps:.2f} TB/s"
                              + (f", {o.peak_share:.0%} of the {o.bound} roof" if o.peak_share is not None else "")
                              for o in rows],
                        hovertemplate="%{text}<extra></extra>")
    return fig
