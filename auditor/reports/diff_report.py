"""A comparison of two inputs (auditor.evidence.compare.Comparison) rendered: a rich table on the
terminal, `diff.json` (its keys are the Comparison's fields, documented in the README) and
`diff.html`; and, for `audit run --baseline DIR`, the summary findings.json keeps under `baseline`
and the "Compared with baseline" section of report.html (diff_view gives both pages the same rows).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table
from rich.text import Text

from auditor import __version__
from auditor.evidence.compare import (BETTER, GONE, NEW, RUN_TIME, WITHIN_NOISE, WORSE, Comparison, Delta,
                                      judged, median_delta)
from auditor.evidence.whole_files import write_whole
from auditor.reports.terminal import printable

VERDICT_STYLE = {BETTER: "green", WORSE: "red", NEW: "yellow", GONE: "cyan", WITHIN_NOISE: "dim"}
TEMPLATES = Path(__file__).parent / "templates"  # (report.html's: the section and style are shared)
GROUP_TITLE = {"run": "run's time", "step": "step", "phase": "phase", "syncs": "syncs", "copies": "copies",
               "memory": "memory", "op": "CPU op (self)", "kernel": "GPU kernel"}


def fmt(value: float | None, unit: str, signed: bool = False) -> str:
    """A number as the tables show it: ms with two decimals, counts with one, bytes in MB."""
    if value is None:
        return "-"
    sign = "+" if signed and value > 0 else ""
    if unit == "ms":
        return f"{sign}{value:.2f} ms"
    if unit == "bytes":
        return f"{sign}{value / 1e6:.2f} MB"
    return f"{sign}{value:.1f}"


def change_text(d: Delta) -> str:
    if d.change is None:
        return "-"
    pct = f" ({d.pct:+.1f}%)" if d.pct is not None else ""
    return fmt(d.change, d.unit, signed=True) + pct


def noise_text(d: Delta) -> str:
    return f"±{fmt(d.noise, d.unit)}" if d.noise is not None else "-"


def headline(c: Comparison) -> str:
    """The one line that says what happened to the run's time per step, the median step beside it
    (the median step alone where a side has no run's time: judged_note says so)."""
    m = median_delta(c)
    if c.judged_by != RUN_TIME:
        if m is None or m.a is None or m.b is None:
            return "median step: not measured on both sides"
        return (f"median step {fmt(m.a, 'ms')} ({c.a.steps} steps) -> {fmt(m.b, 'ms')} ({c.b.steps} steps): "
                f"{change_text(m)}, noise {noise_text(m)}: {_word(m)}")
    d = judged(c)
    assert d is not None and d.a is not None and d.b is not None  # (both sides have the run's time)
    median = ""
    if m is not None and m.a is not None and m.b is not None:
        pct = f" ({m.pct:+.1f}%)" if m.pct is not None else ""
        median = f"; median step {fmt(m.a, 'ms')} -> {fmt(m.b, 'ms')}{pct}"
    return (f"run's time {fmt(d.a, 'ms')}/step ({c.a.run_steps} steps) -> {fmt(d.b, 'ms')}/step ({c.b.run_steps} "
            f"steps): {change_text(d)}, noise {noise_text(d)}: {_word(d)}{median}")


def _word(d: Delta) -> str:
    return {BETTER: "faster", WORSE: "slower"}.get(d.verdict, d.verdict)


def judged_note(c: Comparison) -> str | None:
    """The line that says a comparison is judged by the median step, and why (None when it is
    judged by the run's time)."""
    if c.judged_by == RUN_TIME:
        return None
    lacking = " and ".join(k for k, side in (("A", c.a), ("B", c.b)) if side.run_ms is None)
    return (f"judged by the median step: {lacking} {'has' if len(lacking) == 1 else 'have'} no run's time "
            "(a recording without steps)")


def print_diff(c: Comparison, console: Console | None = None, title: str = "") -> None:
    """The comparison on the terminal: the headline, a table of every number, the findings' changes."""
    console = console or Console(highlight=False, width=max(160, Console().width))  # (no wrapping: greps in CI logs)
    console.print(Text(printable(title or f"audit diff: A = {c.a.label}  B = {c.b.label}")))
    console.print(Text(headline(c), style="bold"))
    if (note := judged_note(c)) is not None:
        console.print(note)
    table = Table(box=None, pad_edge=False)
    for column in ("", "what", "A", "B", "change", "noise", "verdict"):
        table.add_column(column, no_wrap=True, justify="right" if column in ("A", "B", "change", "noise") else "left")
    for d in c.deltas:
        table.add_row(GROUP_TITLE.get(d.group, d.group), Text(printable(_short(d.name))), fmt(d.a, d.unit),
                      fmt(d.b, d.unit), change_text(d), noise_text(d),
                      Text(d.verdict, style=VERDICT_STYLE.get(d.verdict, "")))
    console.print(table)
    for f in c.findings:
        cost = ""
        if f.status == "kept" and f.change is not None:
            cost = f" {fmt(f.cost_a, 'ms')} -> {fmt(f.cost_b, 'ms')} per step ({f.verdict})"
        elif f.cost_a is not None or f.cost_b is not None:
            cost = f" ({fmt(f.cost_a if f.status == 'gone' else f.cost_b, 'ms')} per step)"
        line = Text(f"finding {f.status:<5} ", style=VERDICT_STYLE.get({"gone": GONE, "new": NEW}.get(f.status, ""), ""))
        line.append(Text(printable(f"{f.rule} {f.where} {f.title}{cost}")))
        console.print(line)
    if not c.findings:
        console.print("findings: none on either side")


def _short(name: str, keep: int = 60) -> str:
    return name if len(name) <= keep else name[: keep - 3] + "..."


def document(c: Comparison) -> dict[str, Any]:
    """diff.json: the tool, then the Comparison's fields."""
    return {"tool": {"name": "auditor", "version": __version__}, **msgspec.to_builtins(c)}


def baseline_summary(c: Comparison) -> dict[str, Any]:
    """findings.json's `baseline` key: the baseline's path, the run's time per step of both and
    its change, the median step's, which of the two is judged, the findings gone, new and kept (by
    rule and place), and every other number that changed beyond its noise."""
    run = next((d for d in c.deltas if d.group == "run" and d.name == RUN_TIME), None)
    median = median_delta(c)
    return {
        "path": c.a.label,
        "run_ms": _change(run),
        "median_ms": _change(median),
        "judged_by": c.judged_by,
        "findings": {status: [{"rule": f.rule, "where": f.where, "cost_ms_baseline": _r(f.cost_a),
                               "cost_ms_this": _r(f.cost_b)} for f in c.findings if f.status == status]
                     for status in ("gone", "new", "kept")},
        "changed": [{"group": x.group, "name": x.name, "unit": x.unit, "baseline": _r(x.a), "this": _r(x.b),
                     "change": _r(x.change), "noise": _r(x.noise), "verdict": x.verdict}
                    for x in c.deltas if x is not run and x is not median and x.verdict in (BETTER, WORSE, NEW, GONE)],
    }


def _change(d: Delta | None) -> dict[str, Any]:
    return {"baseline": _r(d.a if d else None), "this": _r(d.b if d else None),
            "change_ms": _r(d.change if d else None), "change_pct": _r(d.pct if d else None, 2),
            "noise_ms": _r(d.noise if d else None), "verdict": d.verdict if d else None}


def _r(v: float | None, digits: int = 3) -> float | None:
    return round(v, digits) if v is not None else None


def diff_view(c: Comparison) -> dict[str, Any]:
    """What the HTML section shows: the headline, a row per number, a row per finding."""
    return {
        "a": c.a.label, "b": c.b.label, "headline": headline(c),
        "rows": [{"group": GROUP_TITLE.get(d.group, d.group), "name": d.name, "a": fmt(d.a, d.unit),
                  "b": fmt(d.b, d.unit), "change": change_text(d), "noise": noise_text(d), "verdict": d.verdict,
                  "cls": d.verdict.replace(" ", "-")} for d in c.deltas],
        "findings": [{"status": f.status, "rule": f.rule, "where": f.where, "title": f.title,
                      "a": fmt(f.cost_a, "ms"), "b": fmt(f.cost_b, "ms"), "verdict": f.verdict,
                      "message": f.message_b or f.message_a} for f in c.findings],
        "notes": [n for n in [judged_note(c)] if n] + [f"A: {n}" for n in c.a.notes] + [f"B: {n}" for n in c.b.notes],
    }


def render_html(c: Comparison) -> str:
    """diff.html: the section report.html shows for a baseline, as a page of its own (the report's
    templates and style; autoescape on, no script)."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.globals["version"] = __version__
    return env.get_template("diff.html.j2").render(diff=diff_view(c))


def write_diff(out: Path, c: Comparison) -> dict[str, Path]:
    """diff.json and diff.html in `out`."""
    paths = {"json": out / "diff.json", "html": out / "diff.html"}
    write_whole(paths["json"], msgspec.json.format(msgspec.json.encode(document(c)), indent=2))
    write_whole(paths["html"], render_html(c))
    return paths
