"""The report draws each plot from real evidence: the numerics series of a run that diverges, with its
first non-finite step marked where the nonfinite rule says it is."""
from __future__ import annotations

import re

from conftest import FIXTURES, audit, plain_run


def test_numerics_plot_marks_the_first_nonfinite_step(tmp_path_factory, numerics_audit):
    a = numerics_audit("numerics_lr_blowup")  # (the session's audit of it, read only)
    assert a.returncode == 0, a.stderr
    step = a.rule("nonfinite")[0]["evidence"]["first_step"]
    html = (a.out / "report.html").read_text()
    assert re.search(r'id="plot-\d+-numerics-plot"', html)
    assert f"first non-finite: step {step}" in html
    # a clean run still plots its series, with nothing marked (the session's plain 5-step run, read only)
    clean = plain_run(tmp_path_factory, "clean")
    assert clean.returncode == 0, clean.stderr
    assert "numerics-plot" in (clean.out / "report.html").read_text()  # loss/grad norms still drawn
    assert "first non-finite" not in (clean.out / "report.html").read_text()


CAUSAL = """
import torch, torch.nn as nn, torch.nn.functional as F

T, C = 8, 16


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(C, 3 * C)
        self.register_buffer("mask", torch.full((T, T), float("-inf")).triu(1))  # causal, by design

    def forward(self, x):
        q, k, v = self.qkv(x).split(C, dim=-1)
        att = q @ k.transpose(-2, -1) / C ** 0.5 + self.mask
        return F.softmax(att, dim=-1) @ v


torch.manual_seed(0)
model = nn.Sequential(Attn(), nn.Linear(C, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for i in range(20):
    loss = model(torch.randn(4, T, C)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_causal_masks_inf_is_not_marked_as_the_first_nonfinite_step(tmp_path):
    """A causal mask's -inf is non-finite by design in every step: nothing went bad, no finding says
    so, and the plot marked "first non-finite: step 0" with nothing beside it."""
    (tmp_path / "causal.py").write_text(CAUSAL)
    a = audit("run", str(tmp_path / "causal.py"), "--steps", "6", "--quiet", "--no-profile", out=tmp_path / "o")
    assert a.returncode == 0, a.stderr
    assert a.evidence["steps"][0]["numerics"]["nonfinite_ops"] >= 1  # the mask's add, seen and judged benign
    assert not a.rule("nonfinite")
    html = (tmp_path / "o" / "report.html").read_text()
    assert "numerics-plot" in html and "first non-finite" not in html


def test_memory_timeline_is_capped_and_keeps_the_peak():
    """A real H100 trace with 12,270 device `[memory]` events: the plotted line keeps at most
    MAX_LINE_POINTS (+2) of them, the same peak and both ends, so the report stays small."""
    import numpy as np

    from auditor.evidence.load import load_paths
    from auditor.reports.plots import MAX_LINE_POINTS, memory_timeline_plot

    path = FIXTURES / "traces" / "h100_owlv2_syncs_dataloader.pt.trace.json.gz"
    ev = load_paths([path])
    mem = ev.trace_data[0].of("memory")
    device = mem[mem["device_type"] == 1]
    assert len(device) > MAX_LINE_POINTS
    fig = memory_timeline_plot(ev)
    line = next(t for t in fig.data if t.name == "GPU allocated")
    assert len(line.y) <= MAX_LINE_POINTS + 2
    mib = device["total_allocated"].to_numpy() / 2**20
    assert max(line.y) == round(float(mib.max()), 3) and min(line.y) == round(float(mib.min()), 3)
    assert line.y[0] == round(float(mib[0]), 3) and line.y[-1] == round(float(mib[-1]), 3)
    assert list(line.x) == sorted(line.x)  # still in time order
    star = next(t for t in fig.data if t.name.startswith("peak") and t.y[0] == max(line.y))
    assert star.x[0] in line.x and np.isclose(star.y[0], mib.max(), atol=1e-3)


def test_memory_timeline_of_an_old_trace_adds_up_the_allocations():
    """Kineto of torch 1.9 (the V100 ResNet trace) records each `[memory]` event's size, negative
    for a free, and no running total: the plot drew the absent total, a flat line at 0 with
    'peak -0.0 MiB', and the parser had turned every free's size into -1. The line is now the
    running sum of the sizes, named as a change since the window opened."""
    import gzip
    import json

    from auditor.evidence.load import load_paths
    from auditor.reports.plots import memory_timeline_plot

    path = FIXTURES / "traces" / "v100_resnet50_dataloader_workers0.pt.trace.json.gz"
    with gzip.open(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    fig = memory_timeline_plot(load_paths([path]))
    for device, label in ((0, "CPU"), (1, "GPU")):
        sizes = [e["args"]["Bytes"] for e in events if e["args"]["Device Type"] == device]
        assert "Total Allocated" not in events[0]["args"] and min(sizes) < 0  # frees are negative
        running = [sum(sizes[:i + 1]) / 2**20 for i in range(len(sizes))]
        line = next(t for t in fig.data if t.name == f"{label} allocated (change since the window opened)")
        assert max(line.y) == round(max(running), 3) and line.y[-1] == round(running[-1], 3)
        assert any(t.name == f"peak {max(running):+.1f} MiB" for t in fig.data)
    assert max(next(t for t in fig.data if t.name.startswith("GPU")).y) > 2000  # 2.6 GiB of activations


def test_per_step_plots_of_a_long_run_are_bounded_and_keep_the_slowest_step():
    """20,000 steps: each per-step plot line holds at most MAX_LINE_POINTS (+2) points (the report
    carried every step), keeping the slowest step and the highest memory."""
    from auditor.evidence import model as m
    from auditor.reports.plots import MAX_LINE_POINTS, memory_plot, step_time_plot

    n = 20000
    steps = [m.StepRecord(index=i, start_s=i * 1e-3, ms=1.0 + (i % 7) * 0.01 + (50.0 if i == 12345 else 0.0),
                          cpu_ms=1.0, rss_bytes=2**30 + i * 4096) for i in range(n)]
    ev = m.Evidence(source="run", target="t.py:step", requested_steps=n, steps=steps)
    line = next(t for t in step_time_plot(ev).data if t.name == "step")
    assert len(line.y) <= MAX_LINE_POINTS + 2 and max(line.y) == round(steps[12345].ms, 3) and 12345 in line.x
    rss = memory_plot(ev).data[0]
    assert len(rss.y) <= MAX_LINE_POINTS + 2 and max(rss.y) == round((2**30 + (n - 1) * 4096) / 2**20, 2)


def test_gpu_efficiency_plots_from_the_owlv2_trace(tmp_path):
    """The H100 owlv2 trace: time per kernel group (softmax 46% first) and a roofline with the
    H100's roofs and the QK^T bmm at ~51 TFLOP/s; both in report.html; a trace without GPU work
    gets neither."""
    from auditor.evidence.load import load_paths
    from auditor.reports.gpu_plots import kernel_group_plot, roofline_plot

    ev = load_paths([FIXTURES / "traces" / "h100_owlv2_syncs_dataloader.pt.trace.json.gz"])
    groups = kernel_group_plot(ev)
    bar = groups.data[0]
    assert list(bar.y)[-1] == "softmax" and bar.text[-1].startswith("46%")
    roof = roofline_plot(ev)
    assert "H100 SXM" in roof.layout.title.text
    assert {t.name for t in roof.data} >= {"bf16/fp16 roof", "fp32 roof", "matmul", "softmax"}
    bmm = next(t for t in roof.data if t.name == "matmul")
    qk = [y for y, text in zip(bmm.y, bmm.text) if "16x5185x64, 16x64x5185" in text]
    assert len(qk) == 1 and 49.5 < qk[0] < 52.5
    a = audit("analyze", str(FIXTURES / "traces" / "h100_owlv2_syncs_dataloader.pt.trace.json.gz"), "-q",
                   out=tmp_path / "o")
    assert a.returncode == 0, a.stderr
    html = (tmp_path / "o" / "report.html").read_text()
    assert re.search(r'id="plot-\d+-kernel-group-plot"', html) and re.search(r'id="plot-\d+-roofline-plot"', html)
    cpu = load_paths([FIXTURES / "traces" / "a100_item_sync_small.pt.trace.json.gz"])
    assert roofline_plot(cpu) is None


def test_the_report_of_a_long_run_stays_under_5_mb(tmp_path):
    """A run longer than a plot's MAX_LINE_POINTS, each step with a host and a device time, memory, a
    loss, a gradient norm and a learning rate: report.html stays under 5 MB, as its size no longer grows
    with the run (the per-step lines cut to MAX_LINE_POINTS, the embedded findings.json document
    without its per-step lists: 20,000 steps gave 4.94 MB, 5.70 MB before); findings.json keeps every step."""
    import re
    import json

    from auditor.app import finish
    from auditor.config import Config
    from auditor.evidence import model as m
    from auditor.evidence.numerics import NumericsStep, OptStep

    n = 2500
    steps = [m.StepRecord(index=i, start_s=i * 1e-2, ms=9.0 + (i % 13) * 0.37, cpu_ms=8.5 + (i % 11) * 0.21,
                          device_ms=9.5 + (i % 17) * 0.29, rss_bytes=2**30 + (i % 101) * 40960,
                          device_allocated=2**32 + (i % 89) * 2**20, device_reserved=2**33,
                          numerics=NumericsStep(ops=10, loss=2.5 / (1 + i * 1e-3) + (i % 7) * 1e-3, loss_finite=True,
                                                losses=1, opt_steps=[OptStep(opt=0, lrs=[1e-3 * (1 - i / n)],
                                                                             grad_norm=0.5 + (i % 19) * 0.013)]))
             for i in range(n)]
    ev = m.Evidence(source="run", target="t.py:step", requested_steps=n, steps=steps)
    try:
        finish(ev, Config(), tmp_path, True, None)
    except SystemExit:
        pass
    html = (tmp_path / "report.html").read_text()
    assert len(html.encode()) < 5_000_000, len(html.encode())
    page = json.loads(re.search(r'<script type="application/json" id="auditor-data">(.*?)</script>', html, re.S)[1])
    assert {"host_ms", "device_ms", "per_step_ms"} <= set(page["findings"]["steps"]["left_out"])
    assert all(len(t.get("y") or ()) <= 1002 for p in page["plots"] for t in p["figure"]["data"])
    assert len(json.loads((tmp_path / "findings.json").read_text())["steps"]["host_ms"]) == n


def test_the_loss_plot_has_readable_log_ticks_and_says_which_steps_it_holds():
    """The docs' run (tests/fixtures/docs): loss ~2.3 and gradient norms 0.08-0.24 on the 11 steps the
    numerics checks ran on, of 30. plotly labels every minor tick of such a range (6, 7, 8, 9, 0.1),
    which overlap; the plot labels 0.1, 0.2, 0.5, 1, 2, says the steps are the checked ones, and spans
    the whole run so that where they stop shows."""
    import msgspec

    from auditor.evidence.model import Evidence
    from auditor.reports.plots import log_ticks, numerics_plot
    from conftest import FIXTURES

    ev = msgspec.json.decode((FIXTURES / "docs" / "audited_train_script" / "evidence.json").read_bytes(), type=Evidence)
    layout = numerics_plot(ev).to_plotly_json()["layout"]
    assert layout["yaxis"]["ticktext"] == ["0.1", "0.2", "0.5", "1", "2"]
    assert layout["title"]["text"] == "Loss and gradient norm (log scale, the 11 checked steps of 30)"
    assert layout["xaxis"]["range"] == [-0.5, 29.5]
    # a range of many decades: one tick a decade, then every other, never more than 8
    assert log_ticks([0.5, 3000])["ticktext"] == ["1", "10", "100", "1000"]
    assert len(log_ticks([1e-12, 1e12])["tickvals"]) <= 8


def test_a_window_that_allocated_nothing_draws_no_memory_plot(tmp_path):
    """A trace whose `[memory]` events all hold 0 allocated (a CPU run's can) drew an empty plot,
    "peak 0.0 MiB"; it draws none. The same events with an allocation draw it."""
    import json

    from auditor.evidence.load import load_paths
    from auditor.reports.plots import memory_timeline_plot

    def trace(totals: list[int]) -> object:
        events = [{"ph": "i", "s": "t", "name": "[memory]", "pid": 1, "tid": 1, "ts": 1000 + 10 * i,
                   "args": {"Device Type": 0, "Device Id": -1, "Addr": 1, "Bytes": 0,
                            "Total Allocated": total, "Total Reserved": 0}} for i, total in enumerate(totals)]
        path = tmp_path / f"t{len(totals)}.pt.trace.json"
        path.write_text(json.dumps({"traceEvents": events}))
        return load_paths([path])

    assert memory_timeline_plot(trace([0, 0, 0])) is None
    fig = memory_timeline_plot(trace([0, 3 * 2**20, 0, 0]))
    assert fig is not None and any(t.name == "peak 3.0 MiB" for t in fig.data)


def test_the_step_time_plot_marks_each_steps_role_and_whose_median_it_draws():
    """The docs' run (tests/fixtures/docs, 30 steps): profiled steps 3-6 and the 11 checked steps are
    marked, the dashed median is named as the 15 timed steps' (the others are slower by the audit's
    own work), and a step axis has whole ticks only."""
    import msgspec

    from auditor.evidence.model import Evidence
    from auditor.reports.plots import step_time_plot

    ev = msgspec.json.decode((FIXTURES / "docs" / "audited_train_script" / "evidence.json").read_bytes(), type=Evidence)
    fig = step_time_plot(ev).to_plotly_json()
    marked = {t["name"]: t["x"] for t in fig["data"]}
    assert marked["profiled step"] == [3, 4, 5, 6]
    assert marked["checked step (numerics checks)"] == [0, 1, 2, 7, 8, 9, 10, 11, 12, 13, 14]
    [note] = fig["layout"]["annotations"]
    assert note["text"] == f"median of the 15 timed steps {ev.median_step_ms():.1f} ms"
    assert fig["layout"]["xaxis"]["tickformat"] == "d" and fig["layout"]["xaxis"]["dtick"] == 3
