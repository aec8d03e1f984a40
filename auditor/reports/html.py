"""`report.html`: one self-contained page a person reads first, and can attach to a bug report.

The page is one jinja2 template (autoescape on) with plotly.js inlined once from the installed plotly
package, the findings.json document embedded as JSON, and no other request: it works offline from
a file:// URL. Python prepares plain view dicts; the template only lays them out, so the HTML has no
logic to test separately. Everything that comes from the user's run (paths, code, op names,
messages, tracebacks) goes through jinja escaping, and the embedded JSON through `script_json`.

Plots come from `auditor.reports.plots.PLOT_BUILDERS`, a list of `(evidence) -> plotly Figure | None`
functions. A builder returns None when its data is absent; one that raises is reported on the page
instead of breaking the report.
"""
from __future__ import annotations

import ast
import base64
import functools
import hashlib
import json
import linecache
import os
import re
import shlex
import textwrap
import urllib.parse
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import msgspec
from markupsafe import Markup

from auditor import __version__
from auditor.evidence import source_access, sources
from auditor.evidence.model import CUDA_STANDIN, Evidence
from auditor.reports.base import Reporter, detail_of, first_sentence
from auditor.reports.figure import Figure
from auditor.reports.own_cost import own_cost_phrase
from auditor.reports.processes_line import started_processes_phrase
from auditor.reports.step_clock import clock_phrase, gpu_line, rehearsed_share
from auditor.evidence.step_clock import rehearsed_device_ms, step_clock
from auditor.reports.time_bar import time_bar
from auditor.reports.findings_json import document
from auditor.reports.patch import patchable
from auditor.reports.plots import MAX_LINE_POINTS, PLOT_BUILDERS, PLOT_TEMPLATE, PlotBuilder
from auditor.reports.sources import CONTEXT_LINES  # (the lines shown around a finding's line: those recorded)
from auditor.evidence.run_time import run_time
from auditor.reports.run_time_lines import parts_line, spread_text, too_few_line
from auditor.reports.terminal import (PER_RULE_LINES, by_cost, checkpoint_overview, elsewhere_phrase, program_phrase,
                                      recoverable, snapshot_overview, steps_of)
from auditor.findings import Finding
from auditor.fixes import make_patch
from auditor.findings import RuleResults
from auditor.reports.window_drop import judged_without, traces_without, traces_without_phrase, window_drop_phrase
from auditor.rules.registry import get_rule

if TYPE_CHECKING:  # (the trace parser loads only when a trace is rendered)
    from auditor.evidence.trace.model import Trace

TEMPLATES = Path(__file__).parent / "templates"

# ---------------------------------------------------------------- escaping

_SCRIPT_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def script_json(data: Any) -> Markup:
    """JSON safe inside <script>: no `</script>`, `<!--` or line separators can end or bend it."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), default=str)
    return Markup(re.sub("[<>&\u2028\u2029]", lambda m: _SCRIPT_ESCAPES[m.group(0)], text))


# ---------------------------------------------------------------- plots

def build_plots(ev: Evidence, builders: list[PlotBuilder] | None = None) -> tuple[list[dict], list[str]]:
    """(plots as {"id", "figure"} with plain-JSON figures, errors of builders that raised)."""
    plots, errors = [], []
    for i, builder in enumerate(builders if builders is not None else PLOT_BUILDERS):
        name = getattr(builder, "__name__", repr(builder))
        try:
            fig = builder(ev)
        except Exception as e:  # a broken extra plot must not cost the user the whole report
            errors.append(f"plot {name} failed: {type(e).__name__}: {e}")
            continue
        if fig is not None:
            if isinstance(fig, Figure):
                figure = json.loads(json.dumps(fig.to_plotly_json(), default=_plain))
            else:
                import plotly.io as pio

                figure = json.loads(pio.to_json(fig, validate=False, engine="json"))
            layout = figure.setdefault("layout", {})
            if "layout" not in (layout.get("template") or {}):  # no template of its own: the page's
                layout.pop("template", None)
            plots.append({"id": f"plot-{i}-{re.sub(r'[^a-z0-9]+', '-', name.lower())}", "figure": figure})
    return plots, errors


def _plain(value: Any) -> Any:
    """A numpy array or scalar in a figure, as JSON takes it."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} in a figure")


def embedded(doc: dict[str, Any]) -> dict[str, Any]:
    """The findings.json document as the page carries it: the per-step lists of a long run (longer
    than a plot's MAX_LINE_POINTS) are left out, named in `steps.left_out`, so the page stays under
    5 MB whatever the run's length; findings.json keeps them whole."""
    steps = doc.get("steps")
    if not isinstance(steps, dict):
        return doc

    def long(v: Any) -> bool:
        return isinstance(v, list) and len(v) > MAX_LINE_POINTS

    short, left = {}, []
    for key, value in steps.items():
        if long(value):
            left.append(key)
            continue
        if isinstance(value, dict):  # (one level down: steps.own_cost's lists of steps)
            cut = [k for k, v in value.items() if long(v)]
            left += [f"{key}.{k}" for k in cut]
            value = {k: v for k, v in value.items() if k not in cut}
        short[key] = value
    return {**doc, "steps": {**short, "left_out": left}} if left else doc


@functools.lru_cache(maxsize=1)
def plot_template() -> dict:
    """PLOT_TEMPLATE as plain JSON: in the page once, applied to each plot without one. Read from
    the copy shipped in templates/ (plotly's `pio.templates[PLOT_TEMPLATE].to_plotly_json()`,
    tests/reports/test_figure.py holds it to plotly's): plotly builds its templates through its
    validating objects, about 0.1 s of every audit."""
    return json.loads((TEMPLATES / f"{PLOT_TEMPLATE}.json").read_text())


# ---------------------------------------------------------------- view data


def fmt_ms(ms: float | None) -> str:
    if ms is None:
        return "-"
    return f"{ms / 1000:.2f} s" if ms >= 10_000 else f"{ms:.1f} ms" if ms >= 10 else \
        f"{ms:.2f} ms" if ms >= 0.01 or ms == 0 else f"{ms:.3g} ms"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def cost_text(f: Finding) -> str:
    """One phrase: how much a finding costs per step and how sure that number is."""
    c = f.cost
    if c is None:
        return "cost not measured"
    parts = []
    if c.ms_per_step is not None:
        parts.append(f"{fmt_ms(c.ms_per_step)}/step")
    if c.share_of_step is not None:
        parts.append(f"{c.share_of_step:.0%} of the run's time")
    if not parts:
        if not c.note:
            return "counted only"
        if c.measured:  # a measured cost that is not time (memory held): the note says it
            return c.note
        # (a note that already says so, "counted, not timed: ...", stands alone)
        return c.note if c.note.startswith(("counted", "not measured")) else f"counted only: {c.note}"
    text = ", ".join(parts) + ("" if c.measured else " (estimated)")
    return f"{text}; {c.note}" if c.note else text


def short_cost(f: Finding) -> str:
    """The findings table's cost: numbers only ('15.4 ms/step, 44%', '0.32 ms/step, 1%, estimated',
    'counted'); the finding's card says how it was measured."""
    c = f.cost
    if c is None:
        return "-"
    if c.ms_per_step is None:
        return c.note if c.measured and c.note and len(c.note) <= 24 else "counted"
    text = f"{fmt_ms(c.ms_per_step)}/step"
    if c.share_of_step is not None:
        text += f", {c.share_of_step:.0%}"
    return text + ("" if c.measured else ", estimated")


def source_context(file: str, line: int, context: int = CONTEXT_LINES,
                   evidence: Evidence | None = None) -> list[dict[str, Any]]:
    """The lines around `line` in the user's file ([] when it is gone): what the finding points at.
    Of a file changed since the run, the lines as the run recorded them, each with the file's
    current text where it differs ("now"; auditor.evidence.sources)."""
    if evidence is not None and (recorded := sources.context(evidence, file, line, context)) is not None:
        return recorded
    path = source_access.resolve(file)  # (only under the source roots: auditor.evidence.source_access)
    if path is None:
        return []
    linecache.checkcache(path)
    lines = linecache.getlines(path)
    if not lines or not 1 <= line <= len(lines):
        return []
    lo, hi = max(1, line - context), min(len(lines), line + context)
    return [{"n": n, "text": lines[n - 1].rstrip("\r\n"), "hit": n == line} for n in range(lo, hi + 1)]


def doc_sections(docs: str) -> list[dict[str, str]]:
    """A rule docstring split at its unindented `Heading:` lines into {"heading", "body"}."""
    sections: list[dict[str, str]] = []
    current: dict[str, Any] = {"heading": "", "lines": []}
    for ln in docs.splitlines():
        m = re.fullmatch(r"([A-Z][\w ]{1,40}):\s*", ln)
        if m:
            if current["heading"] or any(x.strip() for x in current["lines"]):
                sections.append(current)
            current = {"heading": m.group(1), "lines": []}
        else:
            current["lines"].append(ln)
    sections.append(current)
    out = []
    for s in sections:
        body = textwrap.dedent("\n".join(s["lines"])).strip("\n")
        if s["heading"] or body.strip():
            out.append({"heading": s["heading"], "body": body})
    return out


def _value_text(v: Any) -> str:
    """Strings as they are, scalars as Python writes them (True, None, 4), containers as JSON."""
    if isinstance(v, str):
        return v
    if v is None or isinstance(v, (bool, int, float)):
        return repr(v)
    return json.dumps(msgspec.to_builtins(v), default=str)


SERIES_ROWS = 60  # rows of a series table shown; the rest are counted below it


def series_table(v: Any) -> dict[str, Any] | None:
    """A series the evidence holds -- a list of records of scalars (per step: `{"step", "ms",
    "loader_ms", "share"}`; per site) or a list of numbers (a per-step time series) -- as a small
    table for the evidence card: {"columns", "rows", "more"}. None for anything else."""
    if not isinstance(v, list) or not v:
        return None
    scalar = (str, int, float, bool, type(None))
    if all(isinstance(x, dict) and x and all(isinstance(y, scalar) for y in x.values()) for x in v):
        columns: list[str] = []
        for x in v:
            columns.extend(k for k in x if k not in columns)
        # an object's `id` (a DataLoader's, 140490372121104) says nothing to a reader: findings.json keeps it
        columns = [c for c in columns if c != "id"]
        if len(columns) > 12 or not columns:
            return None
        rows = [[_value_text(x.get(c)) if x.get(c) is not None else "-" for c in columns] for x in v[:SERIES_ROWS]]
        columns = [evidence_label(c) for c in columns]
    elif all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        columns = ["#", "value"]
        rows = [[str(i), _value_text(x)] for i, x in enumerate(v[:SERIES_ROWS])]
    else:
        return None
    return {"columns": columns, "rows": rows, "more": max(0, len(v) - SERIES_ROWS)}


def _evidence_rows(evidence: dict[str, Any]) -> list[tuple[str, str, dict[str, Any] | None]]:
    """(key, the value as text, the value as a series table or None) for each evidence entry."""
    rows = []
    for k, v in evidence.items():
        text = _value_text(v)
        rows.append((k, text if len(text) <= 2000 else text[:2000] + " ...", series_table(v)))
    return rows


# An evidence key read as words: its unit in brackets, abbreviations as a person writes them.
_UNITS = {"ms": "ms", "s": "s", "bytes": "bytes", "mb": "MB", "mib": "MiB", "gib": "GiB", "gflop": "GFLOP",
          "pct": "%", "us": "us"}
_WORDS = {"cpu": "CPU", "gpu": "GPU", "rss": "RSS", "fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "gflop": "GFLOP",
          "amp": "AMP", "nccl": "NCCL", "mfu": "MFU", "oom": "OOM", "lr": "LR", "rank": "rank"}


def evidence_label(key: str) -> str:
    """`median_wait_ms` -> "median wait (ms)", `steps_making_an_iterator` -> "steps making an iterator";
    a key that names code (`DataLoader.pin_memory`, `torch.backends.cudnn.benchmark`) as it is."""
    if "." in key or ":" in key or not key.replace("_", "").isalnum() or key != key.lower():
        return key
    words = key.split("_")
    unit = _UNITS.get(words[-1]) if len(words) > 1 else None
    words = [_WORDS.get(w, w) for w in (words[:-1] if unit else words)]
    return " ".join(words) + (f" ({unit})" if unit else "")


def finding_view(i: int, f: Finding, evidence: Evidence | None = None) -> dict[str, Any]:
    """What the template shows for one finding."""
    rule = get_rule(f.rule)
    patch = f.fix.patch if f.fix and f.fix.patch else (make_patch(f.fix.edits) if f.fix and f.fix.edits else "")
    return {
        "anchor": f"finding-{i + 1}",
        "n": i + 1,
        "f": f,
        "cost": cost_text(f),
        "cost_short": short_cost(f),
        "short": first_sentence(f.message),
        "detail": detail_of(f.message),
        "docs": doc_sections(rule.docs()) if rule else [],
        "evidence": _evidence_rows(f.evidence),
        "locations": [{"loc": loc, "context": source_context(loc.file, loc.line, evidence=evidence),
                       "changed": evidence is not None and loc.file in sources.changed(evidence)}
                      for loc in f.locations],
        "patch": [{"text": ln, "kind": _diff_kind(ln)} for ln in patch.splitlines()],
        "config": [(k, _value_text(v)) for k, v in (f.fix.config.items() if f.fix else [])],
        "verified": verified_rows(f),
    }


def verified_rows(f: Finding) -> list[tuple[str, str, str]]:
    """(measure, before, after) of what `audit run --verify` measured for the fix (none when not verified)."""
    v = f.fix.verified if f.fix else None
    if v is None:
        return []
    keys = [k for k in v.before if k != "finding"] + [k for k in v.after if k not in v.before and k != "finding"]
    rows = [("finding reported", "yes" if v.before.get("finding") else "no", "yes" if v.after.get("finding") else "no")]
    for k in keys:
        b, a = v.before.get(k), v.after.get(k)
        if b is None and a is None:
            continue
        rows.append((k, "-" if b is None else _value_text(b), "-" if a is None else _value_text(a)))
    return rows


def _diff_kind(ln: str) -> str:
    if ln.startswith(("+++", "---", "diff ")):
        return "head"
    return {"+": "add", "-": "del", "@": "hunk"}.get(ln[:1], "ctx")


# Patched config: every fix.config key, grouped by what it configures.
_ENV = re.compile(r"^(?:env[:.])?([A-Z][A-Z0-9_]*)$")
_KWARGS = re.compile(r"^(DataLoader|dataloader|Optimizer|optimizer)[.:](\w+)$")


@dataclass
class ConfigGroup:
    title: str
    lines: list[str] = field(default_factory=list)
    python: bool = True  # its lines are Python (or shell, for the environment): they get a Copy button

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    @property
    def copyable(self) -> bool:
        """Copy is offered for text that runs as it is: the shell's exports, the keyword arguments,
        settings that are all Python statements (not `reset_peak_memory_stats = every 500 steps`)."""
        return not self.python or all(_is_python(line) for line in self.lines)


def _is_python(line: str) -> bool:
    try:
        ast.parse(line)
    except SyntaxError:
        return False
    return True


def patched_config(findings: list[Finding]) -> list[ConfigGroup]:
    """Every `fix.config` change across findings, as copyable text per kind.

    Key conventions: `NAME` in capitals (or `env:NAME`) is an environment variable; `DataLoader.kw`
    and `optimizer.kw` are keyword arguments of that call; anything else is a setting shown as
    `key = value` with the rules that asked for it. Two rules asking different values for one key
    are both shown, marked as a conflict.
    """
    wanted: dict[str, dict[str, tuple[Any, list[str]]]] = {}  # key -> value text -> (value, rules)
    for f in findings:
        for k, v in (f.fix.config.items() if f.fix else []):
            wanted.setdefault(k, {}).setdefault(_value_text(v), (v, []))[1].append(f.rule)
    env, kwargs, other = ConfigGroup("Environment variables (shell)", python=False), {}, ConfigGroup("Settings")
    for key, values in wanted.items():
        conflict = len(values) > 1
        for text, (value, rules) in values.items():
            note = f"  # {', '.join(dict.fromkeys(rules))}" + (" (conflicting values)" if conflict else "")
            if m := _ENV.match(key):
                env.lines.append(f"export {m.group(1)}={shlex.quote(text)}{note}")
            elif m := _KWARGS.match(key):
                call = "DataLoader" if m.group(1).lower() == "dataloader" else "optimizer"
                kwargs.setdefault(call, ConfigGroup(f"{call} keyword arguments")).lines.append(
                    f"{m.group(2)}={value!r},{note}")
            else:
                other.lines.append(f"{key} = {text}{note}")
    return [g for g in (env, *kwargs.values(), other) if g.lines]


def patch_files(findings: list[Finding]) -> list[dict[str, str]]:
    """fixes.patch, when it holds code edits, for the Patched config section: what it holds and how
    many of its edits change what the training computes."""
    held = patchable(findings)
    if not held:
        return []
    review = sum(1 for f in held if f.fix is not None and f.fix.changes_numerics)
    what = "every code edit" + (f"; those marked in its first lines ({review}) change what the training computes"
                                if review else "")
    return [{"name": "fixes.patch", "what": what, "how": "review those, then " if review else ""}]


def verdict(ev: Evidence, results: RuleResults) -> dict[str, Any]:
    """The answer at the top of the page: how long a step takes and how much the findings cost."""
    rec = recoverable(ev, results)
    rss = [s.rss_bytes for s in ev.steps if s.rss_bytes is not None]
    dev = [s.device_allocated for s in ev.steps if s.device_allocated is not None]
    return {
        "median_ms": fmt_ms(ev.shown_median_ms()),
        "own_cost": own_cost_phrase(ev),
        "program": program_phrase(ev) if ev.program is not None else None,
        "run": run_view(ev, rec),
        "clock": clock_phrase(ev),
        "processes": started_processes_phrase(ev),
        "bound": step_clock(ev).bound,
        "timed": len(ev.timed_steps()) if ev.steps else None,
        "steps": len(ev.shown_step_ms()),
        "requested": ev.requested_steps,
        "profiled": [s.index for s in ev.steps if s.profiled],
        "recoverable_ms": fmt_ms(rec.ms) if rec.ms is not None else None,
        "recoverable_share": f"{rec.share:.0%}" if rec.share is not None else None,
        "capped": rec.capped,
        "estimated": rec.estimated,
        "counted_only": rec.counted_only,
        "elsewhere": elsewhere_phrase(rec.elsewhere) if rec.elsewhere else None,
        "steps_of": steps_of(ev),
        "peak_rss": fmt_bytes(max(rss)) if rss else None,
        "peak_device": fmt_bytes(max(dev)) if dev else None,
        "device": ev.environment.device,
        "predicted_on": _predicted_on(ev),
        "recording": recording_view(ev) if ev.source == "trace" else None,
        "severities": {s: sum(f.severity == s for f in results.findings) for s in ("error", "warning", "info")},
    }


def _predicted_on(ev: Evidence) -> str | None:
    """The GPU a CUDA rehearsal's GPU figures are predicted for (None: not a rehearsal)."""
    if not ev.environment.rehearsal or not ev.steps:
        return None
    estimate = rehearsed_device_ms(ev)
    return estimate[1] if estimate is not None else "the GPU the device model names"


def run_view(ev: Evidence, rec: Any) -> dict[str, Any] | None:
    """The run's time (auditor.evidence.run_time) as the page shows it: its time per step, its
    parts, the spread of its steps, too few timed steps, and a rehearsal's GPU prediction apart."""
    account = run_time(ev)
    if account is None:
        return None
    gpu = rehearsed_share(ev, rec.total, rec.launches_ms) if rec.ms is not None else None
    return {"base": fmt_ms(account.base_ms), "parts": parts_line(account).split("ms/step ", 1)[1],
            "spread": spread_text(account), "too_few": too_few_line(account),
            "gpu": gpu_line(*gpu) if gpu is not None else None}


def recording_view(ev: Evidence) -> dict[str, Any]:
    """The cards' words for recorded traces analysed on their own, where a run's do not hold:
    steps recorded (nothing ran here), memory from the trace's memory events (there is no process
    RSS), and only the devices and torch version the trace names (this machine's torch is not the
    one that recorded)."""
    from auditor.evidence.snapshot import format_bytes

    shown = ev.shown_trace()
    steps = ""
    if shown is not None:
        one = len(shown.steps) == 1
        steps = (f"ProfilerStep{'' if one else 's'} recorded" if shown.steps_from is None else
                 f"loop iteration{'' if one else 's'} recorded (no ProfilerSteps)")
    devices: list[str] = []
    for trace in ev.trace_data:
        names = [str(p.get("name")) for p in trace.device_properties if p.get("name")]
        if names:
            devices = [f"{n} x{names.count(n)}" if names.count(n) > 1 else n for n in dict.fromkeys(names)]
            break
    about = "; ".join([*devices, *([f"torch {v}"] if (v := ev.environment.torch_version) else [])])
    memory = recorded_peak_memory(ev)
    return {"steps": steps, "device_sub": about,
            "memory": format_bytes(memory[0]) if memory and memory[1] == "peak" else
            (f"+{format_bytes(memory[0])}" if memory else "-"),
            "memory_sub": (f"{memory[2]} allocated at its peak, from the trace's memory events" if memory and
                           memory[1] == "peak" else
                           f"{memory[2]} allocated at its peak, over what it held when the window opened (this "
                           "trace records each allocation's size, not the total)" if memory else
                           "not recorded: the trace has no memory events (profile_memory=True records them)")}


def recorded_peak_memory(ev: Evidence) -> tuple[int, str, str] | None:
    """(bytes, "peak" or "change", which memory) of the recordings' `[memory]` events: the GPU's
    allocated memory at its highest when recorded, else the CPU's; the running sum of the sizes
    for a trace whose events record no total (a change since the window opened, as the memory plot
    draws it). None without memory events."""
    for trace in ev.trace_data:
        mem = trace.of("memory", columns=["device_type", "total_allocated", "bytes"])
        if mem.empty:
            continue
        kinds = mem["device_type"].to_numpy()
        kind = 1 if (kinds == 1).any() else int(kinds[0])
        part = mem[kinds == kind]
        what = {0: "CPU", 1: "GPU"}.get(kind, f"device type {kind}")
        total = part["total_allocated"].to_numpy()
        if (total >= 0).any():
            return int(total.max()), "peak", what
        return int(part["bytes"].to_numpy().cumsum().max()), "change", what
    return None


def snapshot_verdict(ev: Evidence) -> dict[str, Any] | None:
    """The top of the page for memory snapshots analysed on their own (None otherwise): what the
    allocator held (the first snapshot's, the others named), in place of a run's step time,
    recoverable time and peak memory, which a snapshot does not have."""
    from auditor.evidence.snapshot import format_bytes

    snaps = snapshot_overview(ev)
    if not snaps:
        return None
    s = snaps[0]
    where = ", ".join(f"cuda:{d}" for d in s["devices"]) or "no device"
    of = f" ({s['name']}; {len(snaps) - 1} more snapshot(s) in the findings)" if len(snaps) > 1 else ""
    return {
        "reserved": format_bytes(s["reserved"]),
        "reserved_sub": f"in {s['segments']:,} segment{'s' if s['segments'] != 1 else ''} on {where}{of}",
        "allocated": format_bytes(s["allocated"]),
        "allocated_sub": (f"{s['allocated'] / s['reserved']:.0%} of reserved" if s["reserved"] else "nothing reserved")
                         + ("; allocation history recorded" if s["history"] else "; no allocation history"),
        "free": format_bytes(s["free"]),
        "free_sub": f"largest free block {format_bytes(s['largest_free'])}; "
                    f"{format_bytes(s['free_in_empty'])} in wholly empty segments",
    }


def checkpoint_verdict(ev: Evidence) -> dict[str, Any] | None:
    """The top of the page for `audit checkpoint` (None otherwise): what the file holds and whether
    any of it is non-finite, in place of a run's step time, recoverable time and peak memory."""
    ck = checkpoint_overview(ev)
    if ck is None:
        return None
    split = " + ".join(f"{n} {s}" for s, n in ck["sections"].items())
    details = [fmt_bytes(ck["bytes"])] if isinstance(ck["bytes"], int) else []
    details.append(f"{ck['optimizers']} optimizer(s), {ck['schedulers']} scheduler(s)")
    details += [f"{k} {v}" for k in ("epoch", "global_step", "step") if isinstance(v := ck["meta"].get(k), (int, float))]
    bad = ck["nonfinite"]
    return {
        "tensors": f"{ck['tensors']:,}",
        "tensors_sub": (f"{split} tensors, " if split else "") + f"{ck['values']:,} values"
                       + (f", {ck['checked']:,} with floating-point values checked" if ck["checked"] < ck["tensors"] else ""),
        "nonfinite": f"{bad:,} tensor{'s' if bad > 1 else ''}" if bad else "none",
        "nonfinite_sub": (f"{'hold' if bad > 1 else 'holds'} NaN/inf" if bad else "every value is finite"
                          if not ck["sentinels"] else "no value gone bad")
                         + (f"; {ck['sentinels']} callback score(s) at a starting ±inf" if ck["sentinels"] else ""),
        "layout": ck["layout"],
        "layout_sub": "; ".join(details),
    }


def _href(path: str, out_dir: Path) -> str:
    """A relative, percent-encoded link from the report to `path` (never a scheme: cannot run code)."""
    p = Path(path)
    if not p.is_absolute():
        p = out_dir / p
    rel = os.path.relpath(p.resolve(), out_dir.resolve())
    return urllib.parse.quote(Path(rel).as_posix())


def trace_views(ev: Evidence, out_dir: Path) -> dict[str, Any]:
    """Links to the raw traces, and how to open them in TensorBoard and Perfetto.

    Relative trace paths are relative to the run directory, which is where the report is written;
    the same file named relatively (profile.trace_files) and absolutely (traces, after loading) is
    listed once.
    """
    resolved: dict[Path, None] = {}
    for f in [*(ev.profile.trace_files if ev.profile else []), *ev.traces]:
        resolved.setdefault((Path(f) if Path(f).is_absolute() else out_dir / f).resolve(), None)
    links = [{"name": p.name, "href": _href(str(p), out_dir), "path": str(p), "exists": p.exists()}
             for p in list(resolved)[:TRACE_LINKS]]
    return {"links": links, "more": max(0, len(resolved) - TRACE_LINKS),
            "tensorboard": tensorboard_command(out_dir / "tb", list(resolved)), "top_ops": top_ops(ev)}


TRACE_LINKS = 50  # traces linked by name on the page; the rest counted (evidence.json lists all)


TB_SUFFIXES = (".pt.trace.json", ".pt.trace.json.gz")  # the only files torch-tb-profiler reads


def tensorboard_command(tb: Path, traces: list[Path]) -> str | None:
    """How to open the traces in TensorBoard's profiler plugin, which reads `<logdir>/<run>/
    *.pt.trace.json[.gz]` only: the run's own logdir; else the logdir above the first trace's run
    folder; else, for a file named otherwise (`prof.export_chrome_trace("trace.json")`), a copy of
    it under that name in a logdir of its own (such a file's parent's parent, `/` for
    `/tmp/trace.json`, is a logdir where TensorBoard scans the whole disk and finds no run)."""
    if tb.is_dir():
        return f"tensorboard --logdir {shlex.quote(str(tb))}"
    if not traces:
        return None
    first = traces[0]
    if first.name.endswith(TB_SUFFIXES):
        return f"tensorboard --logdir {shlex.quote(str(first.parent.parent))}"
    name = first.name.removesuffix(".gz").removesuffix(".json")
    suffix = ".pt.trace.json.gz" if first.name.endswith(".gz") else ".pt.trace.json"
    return (f"mkdir -p tb/run && cp {shlex.quote(str(first))} tb/run/{shlex.quote(name + suffix)} && "
            f"tensorboard --logdir tb")


def top_ops(ev: Evidence, limit: int = 20) -> list[dict]:
    """The operator table: the one the run recorded, else the first loaded trace's, without the
    operators the audit itself ran (see users_top_ops)."""
    if ev.profile and ev.profile.top_ops:
        return ev.profile.top_ops[:limit]
    for trace in getattr(ev, "trace_data", None) or []:
        rows = users_top_ops(trace, limit)
        if rows:
            return rows
    return []


def users_top_ops(trace: Trace, limit: int = 20) -> list[dict]:
    """Trace.top_ops without the operators run inside the auditor's own ranges (auditor_ops): the
    table says where the program's time goes, and the audit's checks are not the program's. A
    range's time also comes out of the self time of an operator it ran inside (a check in a hook)."""
    ranges = trace.auditor_ranges()
    if not len(ranges):
        return trace.top_ops(limit)
    return trace.top_ops(limit, exclude=trace.auditor_rows(), also_nested=ranges)


def standin_calls(ev: Evidence) -> list[str]:
    """The torch.cuda calls the CUDA stand-ins answered (most often first), at import or in a step.

    `environment.cuda_standins` says the stand-ins were installed, which every run on a machine
    without CUDA does, whether or not the program ever calls torch.cuda: the report claims that
    stand-ins answered (so device numbers are not measurements) only for calls they did answer.
    """
    if not ev.environment.cuda_standins:
        return []
    counts: dict[str, int] = {}
    for _, t in ev.tallies(CUDA_STANDIN, include_setup=True):
        counts[t.what] = counts.get(t.what, 0) + max(t.count, 1)
    return sorted(counts, key=lambda what: (-counts[what], what))


def environment_rows(ev: Evidence) -> list[tuple[str, str]]:
    e = ev.environment
    rows = [("torch", e.torch_version), ("python", e.python_version), ("platform", e.platform),
            ("host", e.hostname), ("device", e.device), ("CUDA available", "yes" if e.cuda_available else "no"),
            ("threads", str(e.num_threads) if e.num_threads is not None else "")]
    for d in e.cuda_devices:  # (the page escapes every value)
        gib = d.get("total_memory", 0) / (1 << 30)
        rows.append((f"GPU {d.get('index', '?')}", f"{d.get('name', '?')}, {gib:.1f} GiB"))
    if calls := standin_calls(ev):
        rows.append(("CUDA stand-ins", f"yes: {', '.join(calls)} answered as an idle device would (no CUDA "
                                       "here), so device numbers are not measurements"))
    return [(k, v) for k, v in rows if v]


# ---------------------------------------------------------------- rendering


def prewarm() -> None:
    """Load what rendering needs (plotly's template and plotly.js, the compiled page) ahead of time: `audit
    run` calls this in a thread while the audited steps run."""
    plot_template()
    _jinja().get_template("report.html.j2")
    plotly_js()
    report_js()


@functools.lru_cache(maxsize=1)
def _jinja() -> jinja2.Environment:
    """Autoescape on for every template, whatever its name; StrictUndefined so a typo fails loudly."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["basename"] = lambda p: os.path.basename(str(p))
    env.filters["evidence_label"] = evidence_label
    env.globals["version"] = __version__
    return env


def _inline_script(js: str, what: str) -> Markup:
    if re.search(r"</script|<!--", js, re.I):  # would end our <script> early
        raise RuntimeError(f"{what} cannot be inlined in a <script> element")
    return Markup(js)


@functools.lru_cache(maxsize=1)
def plotly_js() -> Markup:
    """plotly.js from the installed plotly package, inlined so the page needs no network."""
    from plotly.offline import get_plotlyjs

    return _inline_script(get_plotlyjs(), "the installed plotly.js")


@functools.lru_cache(maxsize=1)
def report_js() -> Markup:
    return _inline_script((TEMPLATES / "report.js").read_text(encoding="utf-8"), "report.js")


def csp_hash(script: str) -> str:
    """A CSP source for one inline script: only scripts we wrote can run, whatever slips into the page."""
    return "'sha256-" + base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode() + "'"


def allocator_views(ev: Evidence) -> list[dict[str, Any]]:
    """The allocator replay per device: its error against the recording, then the what-ifs."""
    from auditor.reports.allocator_view import error_line, reports, steps_line, what_if_lines
    return [{"error": error_line(r), "steps": steps_line(r), "what_if": what_if_lines(r)}
            for r in reports(ev)]


def shown_in_page(evidence: Evidence, results: RuleResults) -> tuple[RuleResults, str | None]:
    """The findings the page shows, and the note saying what it leaves out (None: all shown). Of
    several recordings (a directory of 2,000 traces), each rule's PER_RULE_LINES costliest, as the
    terminal lists them: the page stays a few MB, and every finding is in findings.json."""
    if len(evidence.trace_data) + len(evidence.snapshot_data) < 2:
        return results, None
    kept: set[int] = set()
    counts: dict[str, int] = {}
    for f in by_cost(results.findings):
        counts[f.rule] = counts.get(f.rule, 0) + 1
        if counts[f.rule] <= PER_RULE_LINES:
            kept.add(id(f))
    left = len(results.findings) - len(kept)
    if not left:
        return results, None
    many = sorted(r for r, n in counts.items() if n > PER_RULE_LINES)
    note = (f"This page shows the {PER_RULE_LINES} costliest findings of each rule; {left:,} more "
            f"({', '.join(many)}) are in findings.json")
    shown = replace(results, findings=[f for f in results.findings if id(f) in kept])
    return shown, note


class HtmlReport(Reporter):
    name = "html"
    filename = "report.html"

    def __init__(self, plot_builders: list[PlotBuilder] | None = None) -> None:
        self.plot_builders = plot_builders  # None: auditor.reports.plots.PLOT_BUILDERS

    def render(self, evidence: Evidence, results: RuleResults, out_dir: Path) -> str:
        results, note = shown_in_page(evidence, results)
        if note is None:
            return self._render(evidence, results, out_dir)
        evidence.environment.notes.append(note)  # (this page's alone: taken out again below)
        try:
            return self._render(evidence, results, out_dir)
        finally:
            evidence.environment.notes.remove(note)

    def _render(self, evidence: Evidence, results: RuleResults, out_dir: Path) -> str:
        plots, plot_errors = build_plots(evidence, self.plot_builders)
        scripts = [plotly_js(), report_js()] if plots else [report_js()]
        findings = [finding_view(i, f, evidence) for i, f in enumerate(results.findings)]
        bar = time_bar(evidence, results, {i: v["anchor"] for i, v in enumerate(findings)})
        payload = {"findings": embedded(document(evidence, results)), "plots": plots,
                   "plot_template": plot_template() if plots else None}
        return _jinja().get_template("report.html.j2").render(
            ev=evidence,
            results=results,
            judged_without=judged_without(evidence, results),
            window_drop=(window_drop_phrase(evidence.profile.drop)
                         if evidence.profile is not None and evidence.profile.drop is not None
                         else traces_without_phrase(without) if (without := traces_without(evidence)) else ""),
            verdict=verdict(evidence, results),
            bar=bar,
            ckpt=checkpoint_verdict(evidence),
            snap=snapshot_verdict(evidence),
            allocator=allocator_views(evidence),
            ran=evidence.source == "run",
            findings=findings,
            config=patched_config(results.findings),
            patches=patch_files(results.findings),
            standins=standin_calls(evidence),
            plots=[p["id"] for p in plots],
            plot_errors=plot_errors,
            env_rows=environment_rows(evidence),
            traces=trace_views(evidence, out_dir),
            data_json=script_json(payload),
            plotly_js=plotly_js() if plots else Markup(""),
            report_js=report_js(),
            script_hashes=" ".join(csp_hash(js) for js in scripts),
            fmt_ms=fmt_ms,
            baseline=_baseline_view(evidence),
        )


def _baseline_view(evidence: Evidence) -> dict[str, Any] | None:
    """The "Compared with baseline" section's rows (`audit run --baseline DIR`), None without one."""
    from auditor.reports.diff_report import diff_view

    comparison = evidence.__dict__.get("baseline")
    return diff_view(comparison) if comparison is not None else None
