"""Every reporter over one shared findings fixture (the pyinstrument pattern: one test, all renderers).

`make_case` builds what a 50-step CPU audit of a small trainer produces: a real training script on
disk (so source context and patches read real lines), step records with timed phase tallies,
memory at step boundaries, a profiled window with a trace file, and ranked findings of every cost
kind (measured, estimated, counted only), with config fixes, code edits, a fix that changes
numerics, a location whose file is gone, skipped rules and a rule that crashed. Other reporter
tests import it from here (`from test_reporters import make_case`).
"""
from __future__ import annotations

import json
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from auditor.evidence import model as m
from auditor.evidence.frame import Frame
from auditor.reports.base import Reporter
from auditor.reports.findings_json import FindingsJson
from auditor.reports.html import HtmlReport
from auditor.reports.patch import PatchReport
from auditor.reports.sarif import SarifReport
from auditor.reports.terminal import TerminalSummary
from auditor.findings import Cost, Edit, Finding, Fix, Location
from auditor.findings import RuleResults, rank_key

TRAIN = '''\
import torch
from torch.utils.data import DataLoader, TensorDataset

model = torch.nn.Linear(32, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = TensorDataset(torch.randn(512, 32), torch.randn(512, 1))
loader = DataLoader(data, batch_size=16, num_workers=0)
batches = iter(loader)


def step():
    x, y = next(batches)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"loss {loss.item():.4f}")
    torch.cuda.empty_cache()
    return loss
'''
LOADER_LINE, ITEM_LINE, EMPTY_CACHE_LINE = 7, 17, 18
HOSTILE = ["<script>alert(1)</script>", "\"'><img src=x onerror=alert(1)>", "</script><!--", "\u2028[red]x[/]"]


@dataclass
class Case:
    evidence: m.Evidence
    results: RuleResults
    out_dir: Path
    train: Path


def _trace(out_dir: Path, name: str) -> str:
    """A small Chrome-trace file where the capture puts one (tb/<run>/<worker>.pt.trace.json)."""
    rel = f"tb/run/{name}.pt.trace.json"
    path = out_dir / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "pid": 1, "tid": 1, "ts": 10 * i, "dur": 7}
              for i in range(20)]
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return rel


def _steps(n: int, train: str, hostile: str) -> list[m.StepRecord]:
    loader_at = Frame(train, LOADER_LINE, "<module>", "loader = DataLoader(data, batch_size=16, num_workers=0)")
    item_at = Frame(train, ITEM_LINE, "step", 'print(f"loss {loss.item():.4f}")')
    cache_at = Frame(train, EMPTY_CACHE_LINE, "step", "torch.cuda.empty_cache()")
    steps = []
    for i in range(n):
        profiled = i in (10, 11, 12)
        jitter = (i * 37 % 11) / 10
        ms = 120.0 if i == 0 else (31.0 if profiled else 12.0 + jitter)
        tallies = [
            m.Tally(m.DATA_WAIT, "DataLoader.__next__", loader_at, 1, 4.1 + jitter / 4),
            m.Tally(m.FORWARD, hostile or "Linear", None, 1, 2.9),
            m.Tally(m.BACKWARD, "Tensor.backward", None, 1, 3.4),
            m.Tally(m.OPTIMIZER, "SGD.step", None, 1, 1.0),
            m.Tally(m.SYNC, "Tensor.item", item_at, 1, 0.04),
            m.Tally(m.EMPTY_CACHE, "torch.cuda.empty_cache", cache_at, 1, 0.8),
        ]
        steps.append(m.StepRecord(index=i, start_s=i * 0.013, ms=ms, profiled=profiled,
                                  rss_bytes=310 * 2**20 + i * 2**17, tallies=tallies))
    return steps


def _findings(train: str, hostile: str) -> list[Finding]:
    h = hostile
    return [
        Finding(rule="host-sync", severity="warning", title="Host-device synchronisation inside the step",
                message=f"Tensor.item() syncs 1 time(s) per step at train.py:{ITEM_LINE}{h}",
                locations=[Location(train, ITEM_LINE, 'print(f"loss {loss.item():.4f}")' + h)],
                evidence={"syncs_per_step": 1, "what": "Tensor.item" + h, "steps": list(range(50))},
                cost=Cost(ms_per_step=None, share_of_step=None, measured=False,
                          note="CPU-only run: counted; each sync waits for the GPU queue on a device"),
                fix=Fix(summary="Log the loss every N steps instead of every step.",
                        config={"log_every_n_steps": 50},
                        edits=[Edit(train, ITEM_LINE, ITEM_LINE,
                                    ["    if step.n % 50 == 0:", '        print(f"loss {loss.item():.4f}")'])])),
        Finding(rule="dataloader-bound", severity="warning", title="The step waits for input data",
                message="34% of each step waits in DataLoader.__next__ (num_workers=0).",
                locations=[Location(train, LOADER_LINE, "loader = DataLoader(data, batch_size=16, num_workers=0)")],
                evidence={"data_wait_ms": 4.2, "num_workers": 0, "op" + h: h},
                cost=Cost(ms_per_step=4.2, share_of_step=0.34, measured=True),
                fix=Fix(summary="Load batches in worker processes" + h,
                        config={"DataLoader.num_workers": 4, "DataLoader.pin_memory": True, "OMP_NUM_THREADS": "4",
                                "dataloader.persistent_workers" + h: True},
                        edits=[Edit(train, LOADER_LINE, LOADER_LINE,
                                    ["loader = DataLoader(data, batch_size=16, num_workers=4, pin_memory=True)"])])),
        Finding(rule="forced-cleanup", severity="info", title="Allocator cache emptied every step",
                message="torch.cuda.empty_cache() runs every step.",
                locations=[Location(train, EMPTY_CACHE_LINE, "torch.cuda.empty_cache()")],
                evidence={"calls": 50},
                cost=Cost(ms_per_step=0.8, share_of_step=0.065, measured=False, note="estimated from call time"),
                fix=Fix(summary="Remove the call.", config={"torch.cuda.empty_cache": "off"},
                        edits=[Edit(train, EMPTY_CACHE_LINE, EMPTY_CACHE_LINE, ["    pass  # was empty_cache()"])])),
        Finding(rule="anomaly-mode", severity="error", title="Autograd anomaly detection is on during training",
                message="Anomaly detection was on in 50 of 50 steps.",
                locations=[Location("/nonexistent/gone.py", 3, "torch.autograd.set_detect_anomaly(True)")],
                cost=Cost(ms_per_step=None, share_of_step=None, measured=False),
                fix=Fix(summary="Turn anomaly detection off.", config={"torch.autograd.set_detect_anomaly": False},
                        edits=[Edit(train, 1, 1, ["import torch  # changed numerics"])], changes_numerics=True)),
    ]


def make_case(tmp_path: Path, steps: int = 50, hostile: str = "") -> Case:
    """A complete audit's evidence and results; `hostile` is mixed into every user-supplied string."""
    proj = tmp_path / ("proj" + hostile.replace("/", "_")[:0])
    proj.mkdir(parents=True, exist_ok=True)
    train = proj / "train.py"
    train.write_text(TRAIN)
    out_dir = tmp_path / "run"
    out_dir.mkdir(exist_ok=True)
    trace = _trace(out_dir, "host_1" + ("-" + "x" if hostile else ""))
    env = m.Environment(torch_version="2.13.0+cpu", python_version=platform.python_version(),
                        platform=platform.platform() + hostile, hostname="ci-host", device="cpu",
                        cuda_standins=True, num_threads=2, env_vars={"OMP_NUM_THREADS": "2" + hostile},
                        backend_flags={"cudnn.benchmark": False},
                        notes=["CPU-only run: host syncs are counted, not timed." + hostile])
    evidence = m.Evidence(
        source="run", target=f"{train}:step{hostile}", requested_steps=steps, environment=env,
        steps=_steps(steps, str(train), hostile),
        profile=m.ProfileWindow(steps=[10, 11, 12], trace_files=[trace],
                                top_ops=[{"name": "aten::addmm" + hostile, "count": 60, "self_ms": 1.25,
                                          "total_ms": 2.5}]),
        ending=m.Ending(status="completed"), traces=[trace])
    findings = sorted(_findings(str(train), hostile), key=rank_key)
    results = RuleResults(findings=findings,
                          skipped=[{"rule": "oom-risk", "reason": "needs a CUDA device" + hostile}],
                          errors=[{"rule": "step-slowdown", "error": "ZeroDivisionError: float division" + hostile,
                                   "traceback": "Traceback ..."}],
                          suppressed=1)
    return Case(evidence, results, out_dir, train)


REPORTERS: list[type[Reporter]] = [FindingsJson, HtmlReport, SarifReport, PatchReport,
                                   TerminalSummary]


def _text(data: str | bytes) -> str:
    return data.decode("utf-8") if isinstance(data, bytes) else data


@pytest.mark.parametrize("reporter_cls", REPORTERS, ids=lambda c: c.name)
def test_every_reporter_renders_the_shared_findings(reporter_cls: type[Reporter], tmp_path: Path) -> None:
    case = make_case(tmp_path)
    reporter = reporter_cls()
    path = reporter.write(case.evidence, case.results, case.out_dir)
    assert path == case.out_dir / reporter.filename and path.stat().st_size > 0
    text = path.read_text(encoding="utf-8")
    assert text == _text(reporter.render(case.evidence, case.results, case.out_dir)), "output is not reproducible"
    # Every finding reaches every output, except fixes.patch, which holds those with code edits.
    expected = {f.rule for f in case.results.findings}
    if reporter_cls is PatchReport:
        expected = {f.rule for f in case.results.findings if f.fix and f.fix.edits}
        assert "#   anomaly-mode" in text and "[changes results: review it]" in text
    for rule in expected:
        assert rule in text, f"{reporter.name} output does not mention {rule}"


@pytest.mark.parametrize("reporter_cls", REPORTERS, ids=lambda c: c.name)
def test_every_reporter_handles_an_empty_audit(reporter_cls: type[Reporter], tmp_path: Path) -> None:
    """A run that crashed before its first step still gets every output (or an empty patch)."""
    ev = m.Evidence(target="t.py:step", ending=m.Ending(status="crashed", message="Segmentation fault",
                                                        returncode=-11, signal="SIGSEGV"))
    out = _text(reporter_cls().render(ev, RuleResults(), tmp_path))
    if reporter_cls is PatchReport:
        assert out == ""
    else:
        assert out.strip()
        if reporter_cls in (HtmlReport, TerminalSummary):
            assert "crashed" in out


def test_terminal_summary_is_most_costly_first_and_plain(tmp_path: Path) -> None:
    import io

    from rich.console import Console

    from auditor.reports.terminal import print_summary

    case = make_case(tmp_path, hostile="[red]x[/]")
    HtmlReport().write(case.evidence, case.results, case.out_dir)
    buf = io.StringIO()
    print_summary(case.evidence, case.results, case.out_dir, Console(file=buf, highlight=False, soft_wrap=True))
    out = buf.getvalue()
    assert "\x1b[" not in out, "colour codes in non-TTY output"
    lines = out.splitlines()
    finding_lines = [ln for ln in lines if ln.split(" ", 1)[0] in ("error", "warning", "info")]
    assert [ln.split()[1] for ln in finding_lines] == ["dataloader-bound", "forced-cleanup", "anomaly-mode",
                                                        "host-sync"]
    assert " 4.20 ms 34% " in finding_lines[0]
    assert "[red]x[/]" in out  # markup in user text is printed, not interpreted
    assert f"train.py:{LOADER_LINE}" in finding_lines[0]
    assert lines[-1] == f"report: {case.out_dir / 'report.html'}"
    assert "rule step-slowdown failed" in out


def test_control_characters_of_user_data_are_escaped_in_the_terminal_and_summary(tmp_path: Path) -> None:
    """Op names, target names and messages come from the user's data: an escape sequence in them
    would clear the screen, a newline would start a line that looks like a finding. Every line of
    the terminal summary and summary.txt shows them escaped (they were printed raw)."""
    import io

    from rich.console import Console

    from auditor.reports.terminal import print_summary

    hostile = "\x1b[2J\nerror fake-rule train.py:1 spoofed\r\u202e"
    case = make_case(tmp_path, hostile=hostile)
    buf = io.StringIO()
    print_summary(case.evidence, case.results, case.out_dir, Console(file=buf, highlight=False, soft_wrap=True))
    summary = TerminalSummary().render(case.evidence, case.results, case.out_dir)
    for out in (buf.getvalue(), summary):
        assert "\x1b" not in out and "\r" not in out and "\u202e" not in out
        assert not [ln for ln in out.splitlines() if ln.startswith("error fake-rule")]
        assert "\\x1b[2J\\nerror fake-rule" in out


def test_sarif_and_json_agree_on_findings(tmp_path: Path) -> None:
    case = make_case(tmp_path)
    doc = json.loads(FindingsJson().render(case.evidence, case.results, case.out_dir))
    sarif = json.loads(SarifReport().render(case.evidence, case.results, case.out_dir))
    assert [f["rule"] for f in doc["findings"]] == [r["ruleId"] for r in sarif["runs"][0]["results"]]


def test_html_is_self_contained_and_small(tmp_path: Path) -> None:
    """One file, no fetches: no external script, stylesheet, font or image; under 5 MB for 50 steps."""
    import re

    case = make_case(tmp_path, steps=50)
    html = HtmlReport().render(case.evidence, case.results, case.out_dir)
    assert len(html.encode("utf-8")) < 5_000_000
    assert html.count("plotly.js v") == 1, "plotly.js must be inlined exactly once"
    assert not re.search(r"<(script|img|iframe)[^>]*\bsrc=|<link\b|@import|url\(\s*['\"]?https?:", html, re.I)
    from auditor.reports.html import plotly_js

    ours = html.replace(str(plotly_js()), "")  # plotly.js holds attribution URLs in its own strings
    external = set(re.findall(r'href="(https?://[^"]+)"', ours))
    assert external <= {"https://ui.perfetto.dev"}, external  # a link a person may click, never fetched


def test_script_json_cannot_end_the_script_element() -> None:
    from auditor.reports.html import script_json

    text = str(script_json({"m": "</script><!-- \u2028\u2029 & <b>"}))
    assert "<" not in text and ">" not in text and "\u2028" not in text and "\u2029" not in text
    assert json.loads(text) == {"m": "</script><!-- \u2028\u2029 & <b>"}


def test_patched_config_groups_and_flags_conflicts() -> None:
    from auditor.reports.html import patched_config

    def f(rule: str, config: dict) -> Finding:
        return Finding(rule=rule, severity="warning", title=rule, message="m", fix=Fix(summary="s", config=config))

    groups = {g.title: g.text for g in patched_config([
        f("a", {"OMP_NUM_THREADS": 4, "DataLoader.num_workers": 4, "torch.backends.cudnn.benchmark": True}),
        f("b", {"env:PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "DataLoader.num_workers": 8,
                "optimizer.foreach": True, "note": "it's quoted"}),
    ])}
    assert groups["Environment variables (shell)"].splitlines() == [
        "export OMP_NUM_THREADS=4  # a", "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # b"]
    assert groups["DataLoader keyword arguments"].splitlines() == [
        "num_workers=4,  # a (conflicting values)", "num_workers=8,  # b (conflicting values)"]
    assert groups["optimizer keyword arguments"] == "foreach=True,  # b"
    assert groups["Settings"].splitlines() == ["torch.backends.cudnn.benchmark = True  # a", "note = it's quoted  # b"]


def test_copy_is_offered_only_for_text_that_runs_as_it_is() -> None:
    """Copy for the shell's exports, keyword arguments and Python settings; none for a group holding
    a setting that is advice, not code."""
    from auditor.reports.html import patched_config

    def f(config: dict) -> Finding:
        return Finding(rule="r", severity="warning", title="r", message="m", fix=Fix(summary="s", config=config))

    groups = {g.title: g.copyable for g in patched_config([f({"OMP_NUM_THREADS": 4, "DataLoader.num_workers": 4,
                                                               "torch.backends.cudnn.benchmark": True})])}
    assert groups == {"Environment variables (shell)": True, "DataLoader keyword arguments": True, "Settings": True}
    advice = patched_config([f({"reset_peak_memory_stats": "every 500 steps or never"})])
    assert [(g.title, g.copyable) for g in advice] == [("Settings", False)]


def test_plot_builders_extend_the_page(tmp_path: Path) -> None:
    """Plot builders are plain functions: one added to the list is drawn; one that raises is
    reported on the page and the rest of the report still renders; one returning None adds nothing."""
    import plotly.graph_objects as go

    from auditor.reports.plots import PLOT_BUILDERS

    def loss_curve(ev: m.Evidence) -> go.Figure:
        return go.Figure(go.Scatter(x=[s.index for s in ev.steps], y=[1 / (1 + s.index) for s in ev.steps]))

    def broken(ev: m.Evidence) -> go.Figure:
        raise ValueError("no snapshot")

    case = make_case(tmp_path, steps=5)
    builders = [*PLOT_BUILDERS, loss_curve, broken, lambda ev: None]
    html = HtmlReport(plot_builders=builders).render(case.evidence, case.results, case.out_dir)
    assert f'id="plot-{len(PLOT_BUILDERS)}-loss-curve"' in html
    assert "plot broken failed: ValueError: no snapshot" in html
    assert html.count('class="plot"') == 4


if __name__ == "__main__":  # pragma: no cover - render the fixture by hand: python tests/test_reporters.py DIR
    out = Path(sys.argv[1])
    c = make_case(out)
    for cls in REPORTERS:
        print(cls().write(c.evidence, c.results, c.out_dir))
