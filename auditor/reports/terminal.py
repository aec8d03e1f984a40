"""The few lines `audit` prints when it finishes: what costs most, and where the full report is.

One line per finding, most costly first (`severity rule file:line message (cost)`), so a person
can act on the top line without opening anything. User text is added as rich `Text`, never as
markup, so a message holding `[red]` or `[/]` prints as written. Colour comes only on a TTY (rich
decides; NO_COLOR is honoured), and lines are not wrapped, so the output greps well in CI logs.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from auditor.evidence.model import Evidence, WindowCut
from auditor.evidence.loops import loops, medians
from auditor.reports.allocator_view import lines as allocator_lines
from auditor.reports.base import Reporter, first_sentence
from auditor.reports.own_cost import own_cost_phrase
from auditor.reports.processes_line import started_processes_phrase
from auditor.reports.rehearsal_line import no_gpu_work_phrase
from auditor.reports.run_time_lines import parts_line, spread_line, too_few_line
from auditor.reports.step_clock import LAUNCH_RULES, clock_phrase, gpu_line, rehearsed_share
from auditor.evidence.step_clock import step_clock
from auditor.evidence.run_time import run_time
from auditor.findings import DEVICE, HOST, STEP, Finding, severity_rank, share_of_step, step_basis_ms, together_ms
from auditor.findings import RuleResults
from auditor.reports.window_drop import judged_without, traces_without, traces_without_phrase, window_drop_phrase

# Control characters (C0, DEL, C1), line and paragraph separators and bidirectional overrides: in
# text from the user's data (op names from a trace, target names, messages) they would move the
# cursor, clear the screen or start a line that looks like a finding.
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` with each control character written as its escape (`\\x1b`, `\\n`), so that what is
    printed is one line that shows what it holds."""
    return CONTROL.sub(_escape, text)


def _escape(m: re.Match) -> str:
    c = m.group()
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def printable_line(line: Text) -> Text:
    """A summary line with its control characters escaped (see printable), its styles kept."""
    plain = line.plain
    if not CONTROL.search(plain):
        return line
    cuts = sorted({0, len(plain)} | {s.start for s in line.spans} | {s.end for s in line.spans})
    out = Text(style=line.style, end=line.end)
    for a, b in zip(cuts, cuts[1:]):
        piece = Text(printable(plain[a:b]))
        for span in line.spans:
            if span.start <= a and span.end >= b:
                piece.stylize(span.style)
        out.append(piece)
    return out


SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}
OUTPUTS = ("report.html", "findings.json", "findings.sarif", "fixes.patch")


@dataclass(frozen=True)
class Recoverable:
    """Time the warnings' fixes together would save per step: each warning's cost (what its fix
    saves, auditor.rules.attribution), each stretch of time once (a cost another finding's cost
    holds is left out), host-side savings taken off the host's clock and device-side ones off the
    device's, the step after them the longer clock again (auditor.findings.together_ms), on the
    run's time per step (auditor.evidence.run_time: stalls and the time between steps in it): never
    more than the run's time above its floor, the device's own work. Info findings (a verdict, not a
    fix to apply) are not added. Only the findings on the recording whose steps the headline shows
    are summed (headline_scope): a cost is per step of its own recording, and two recordings' steps
    are not one step."""

    ms: float | None  # None: no finding has a time cost
    share: float | None  # of the run's time per step, as a finding's share_of_step is (auditor.findings.share_of_step)
    capped: bool  # the sum exceeded the step (findings overlap), so it was capped
    estimated: bool  # some summed costs are estimates, not measurements
    counted_only: int  # findings with no time cost (counted, or not measurable on this run)
    largest: float | None = None  # ms/step of the costliest finding alone (what a capped sum still says)
    elsewhere: int = 0  # other recordings (traces) whose timed findings are not in the sum
    launches_ms: float = 0.0  # of `ms`, what fixes that launch fewer kernels save (step_clock.LAUNCH_RULES)
    total: float = 0.0  # the summed costs before they are taken together (what a rehearsal's GPU line starts from)


def _trace_key(path: Any) -> str:
    return os.path.realpath(str(path))


def headline_scope(evidence: Evidence) -> set[str] | None:
    """The traces whose findings the headline adds to its step (real paths), or None when every
    finding counts (no trace was read). A run: its own profiled window; recordings: the trace whose
    steps are shown, else the first one. Findings on other traces (another run's window, another
    rank, a trace given beside a run) are per step of their own recording."""
    traces = evidence.trace_data
    if not traces:
        return None
    if evidence.source == "run":
        return {_trace_key(p) for p in (evidence.profile.trace_files if evidence.profile else [])}
    shown = evidence.shown_trace() or traces[0]
    return {_trace_key(shown.path)}


def in_scope(f: Finding, scope: set[str] | None) -> bool:
    trace = f.evidence.get("trace") if isinstance(f.evidence, dict) else None
    return scope is None or not isinstance(trace, str) or _trace_key(trace) in scope


def _held_elsewhere(f: Finding, timed: list[Finding]) -> bool:
    """True when another timed finding's cost already holds this one's (Cost.within): the rule it
    names reported on the same recording (evidence "trace"; both absent counts as the same). Its
    container absent (below its threshold, ignored), the cost is a saving of its own."""
    container = f.cost.within if f.cost is not None else None
    if not container:
        return False
    scope = f.evidence.get("trace")
    return any(g is not f and g.rule == container and g.evidence.get("trace") == scope for g in timed)


def small_ms(ms: float) -> str:
    """Milliseconds to two decimals, or three significant digits below 0.01 ms (an estimated cost
    of a few microseconds a step is not "0.00")."""
    return f"{ms:.2f}" if ms >= 0.01 or ms == 0 else f"{ms:.3g}"


def recoverable(evidence: Evidence, results: RuleResults) -> Recoverable:
    timed = [f for f in results.findings if f.cost is not None and f.cost.ms_per_step is not None]
    counted_only = len(results.findings) - len(timed)
    scope = headline_scope(evidence)
    elsewhere = len({_trace_key(f.evidence["trace"]) for f in timed if not in_scope(f, scope)})
    timed = [f for f in timed if in_scope(f, scope)]
    if not timed:
        return Recoverable(None, None, False, False, counted_only, elsewhere=elsewhere)
    warned = [f for f in timed if severity_rank(f.severity) >= severity_rank("warning")]
    if not warned:
        return Recoverable(None, None, False, False, counted_only, elsewhere=elsewhere)
    # e.g. host-sync's idle time behind its waits, where gpu-idle's idle total still holds it
    summed = [f for f in warned if not _held_elsewhere(f, warned)]
    sides = _sides()
    per_side = {HOST: 0.0, DEVICE: 0.0, STEP: 0.0}
    for f in summed:
        ms = f.cost.ms_per_step  # type: ignore[union-attr]
        # (a stall's part of a cost: while the step stalls both clocks wait, so its fix saves it whole)
        stall = min(ms, float(f.evidence.get("stall_ms_per_step") or 0.0)) if isinstance(f.evidence, dict) else 0.0
        per_side[sides.get(f.rule, HOST)] += ms - stall  # type: ignore[operator]
        per_side[STEP] += stall
    total = sum(per_side.values())
    ms = round(_together(evidence, per_side), 3)
    capped = ms < total - 0.0005
    # (the share as each finding's is taken: one finding alone prints the same percentage here)
    return Recoverable(ms, share_of_step(ms, step_basis_ms(evidence)), capped,
                       any(not f.cost.measured for f in summed),  # type: ignore[union-attr]
                       counted_only, max(f.cost.ms_per_step for f in warned),  # type: ignore[union-attr, type-var]
                       elsewhere, sum(f.cost.ms_per_step for f in summed if f.rule in LAUNCH_RULES),  # type: ignore[union-attr, misc]
                       total=round(total, 3))


def _together(evidence: Evidence, per_side: dict[str, float]) -> float:
    """What the savings on each side save together of the run's time per step (findings.together_ms
    on the run's clocks: the median step's, each with the time the run spends past that step, in
    stalls and between the steps), never more than the run's time above its floor (the device's
    own work per step, where known)."""
    base = step_basis_ms(evidence)
    median = evidence.shown_median_ms()
    clock = step_clock(evidence, None if evidence.steps else evidence.shown_trace())
    # a recording with no device span but its device work known (busy time): the host is the bound
    bound = clock.bound or ("host" if clock.device_busy_ms and not evidence.steps else None)
    step = clock.step_ms if clock.step_ms is not None else median
    extra = (base or 0.0) - (step or 0.0)  # (the run's time past its median step: stalls, time between steps)
    host = (clock.host_ms if clock.host_ms is not None else median)
    ms = together_ms(per_side[HOST], per_side[DEVICE], per_side[STEP], base, bound,
                     host + extra if host is not None else None,
                     clock.device_ms + extra if clock.device_ms is not None else None,
                     clock.device_busy_ms, clock.waited_ms)
    account = run_time(evidence)
    floor = account.floor_ms if account is not None and account.floor_ms is not None else 0.0
    return max(0.0, min(ms, base - floor)) if base else ms


def _sides() -> dict[str, str]:
    """Each rule's Rule.saves_on: which clock its fix shortens."""
    from auditor.rules.registry import all_rules

    return {rule_id: cls.saves_on for rule_id, cls in all_rules().items()}


def steps_of(evidence: Evidence) -> str:
    """Where the headline's steps come from, when that is not plain: several traces were read and
    the steps are one trace's (` in <label>`); else empty."""
    shown = evidence.shown_trace()
    return f" in {shown.label}" if shown is not None and len(evidence.trace_data) > 1 else ""


def program_phrase(evidence: Evidence) -> str:
    """How a whole program's steps were found and how it ended, as the reports say it."""
    p = evidence.program
    text = f"steps: {p.steps_found}"
    text += loops_phrase(evidence)
    if p.skipped:
        text += f"; the first {p.skipped} run unaudited (--skip)"
    if p.ended_by_audit:
        text += f"; the audit ended the program after {len(evidence.steps)} step(s), as a Ctrl-C does"
        if p.after_stop:  # (its Ctrl-C path: the audited steps are whole)
            text += f"; it caught that interrupt, went on and raised {p.after_stop}, as after a Ctrl-C there"
    elif p.exit_code is not None:
        text += f"; the program exited with code {p.exit_code}"
    return text


def loops_phrase(evidence: Evidence) -> str:
    """Where the program trained in several loops (auditor.evidence.loops): which steps each ran
    and its median, since the headline's median is over them all; else empty."""
    parts = loops([s for s in evidence.steps if not s.failed])
    if len(parts) < 2:
        return ""
    timed = medians(parts, evidence.median_basis())
    unprofiled = medians(parts, [s for s in evidence.steps if not s.profiled])
    shown = [f"{p[0].index}-{p[-1].index} ("
             + (f"{ms:.2f} ms" if ms is not None else f"{other:.2f} ms, all with the audit's checks" if other is not None
                else "profiled only") + ")"
             for p, ms, other in zip(parts, timed, unprofiled)]
    return (f"; in {len(parts)} training loops, each of other forward, backward or optimizer calls: steps "
            f"{', '.join(shown)}, the headline's median over them all")


def elsewhere_phrase(n: int) -> str:
    return f"findings on {n} other trace{'s' if n > 1 else ''} not added in (their costs are per step of their own trace)"


def checkpoint_overview(evidence: Evidence) -> dict[str, Any] | None:
    """What `audit checkpoint` read, as both reports state it (None for anything else): a checkpoint
    has tensors, not steps, so a run's step-time summary would only say "0 step(s)" about it."""
    ck = evidence.checkpoint if evidence.source == "checkpoint" else None
    if ck is None:
        return None
    tensors = ck.tensors
    sections = {s: n for s in ("model", "optimizer", "callback", "other") if (n := sum(t.section == s for t in tensors))}
    return {"layout": ck.layout or "other", "bytes": ck.bytes, "tensors": len(tensors),
            "checked": sum(t.checked for t in tensors),
            "values": sum(t.numel for t in tensors), "sections": sections,
            "nonfinite": sum(t.bad for t in tensors), "sentinels": sum(t.sentinel for t in tensors),
            "optimizers": len(ck.optimizers), "schedulers": len(ck.schedulers), "meta": ck.meta}


def snapshot_overview(evidence: Evidence) -> list[dict[str, Any]] | None:
    """What `audit analyze` read from CUDA memory snapshots given on their own (None otherwise),
    one entry per snapshot: a snapshot is the allocator's state, not steps, so a run's step-time
    summary would only say "0 step(s)" and "no device allocator numbers" about it."""
    snaps = evidence.snapshot_data if evidence.source == "snapshot" else []
    if not snaps:
        return None
    out = []
    for snap in snaps:
        t = snap.totals
        out.append({"name": Path(snap.path).name, "devices": sorted({s.device for s in snap.segments}),
                    "segments": t.segments, "reserved": t.reserved, "allocated": t.allocated, "free": t.free,
                    "largest_free": t.largest_free, "free_in_empty": t.free_in_empty_segments,
                    "history": len(snap.histories) > 0})
    return out


def snapshot_phrase(s: dict[str, Any]) -> str:
    """One snapshot's state, as the head line and the page say it."""
    from auditor.evidence.snapshot import format_bytes

    where = ", ".join(f"cuda:{d}" for d in s["devices"]) or "no device"
    return (f"{format_bytes(s['reserved'])} reserved in {s['segments']:,} segment{'s' if s['segments'] != 1 else ''} "
            f"on {where}, {format_bytes(s['allocated'])} allocated, {format_bytes(s['free'])} free inside them "
            f"(largest free block {format_bytes(s['largest_free'])})")


def nonfinite_phrase(n: int, sentinels: int = 0) -> str:
    """How many of a checkpoint's tensors hold NaN/inf, as a clause (callback sentinels apart)."""
    text = "none holds NaN/inf" if n == 0 else f"{n} tensor{'s hold' if n > 1 else ' holds'} NaN/inf"
    if sentinels:
        text += (f" but {'a callback score' if sentinels == 1 else f'{sentinels} callback scores'} at "
                 "a starting ±inf (a sentinel, not a value gone bad)")
    return text


def checked_phrase(ck: dict[str, Any]) -> str:
    """How many tensors were read and how many had values to check ("7 tensors checked")."""
    n, checked = ck["tensors"], ck["checked"]
    split = ", ".join(f"{k} {s}" for s, k in ck["sections"].items())
    text = f"{n:,} tensor{'s' if n != 1 else ''}" + (f" ({split})" if split else "")
    if checked == n:
        return f"{n:,} tensor{'s' if n != 1 else ''} checked" + (f" ({split})" if split else "")
    if checked == 0:
        return text + ", none with floating-point values to check"
    return text + f", {checked:,} with floating-point values checked"


def _checkpoint_head(evidence: Evidence, ck: dict[str, Any]) -> Text:
    return Text(f"audit of checkpoint {evidence.target} ({ck['layout']}): {checked_phrase(ck)}, "
                f"{ck['values']:,} values; {nonfinite_phrase(ck['nonfinite'], ck['sentinels'])}")


def by_cost(findings: list[Finding]) -> list[Finding]:
    """Most costly first; findings without a time cost keep their ranked order after them."""
    def key(item: tuple[int, Finding]) -> tuple:
        i, f = item
        ms = f.cost.ms_per_step if f.cost and f.cost.ms_per_step is not None else None
        share = f.cost.share_of_step if f.cost and f.cost.share_of_step is not None else None
        return (ms is None, -(ms or 0.0), -(share or 0.0), i)
    return [f for _, f in sorted(enumerate(findings), key=key)]


def _short_path(file: str) -> str:
    try:
        rel = os.path.relpath(file)
    except ValueError:  # another drive on Windows
        return file
    return rel if not rel.startswith("..") else file


def _cost(f: Finding) -> str:
    c = f.cost
    if c is None:
        return ""
    if c.ms_per_step is not None:
        text = f"{small_ms(c.ms_per_step)} ms/step"
        if c.share_of_step is not None:
            text += f", {c.share_of_step:.0%}"
        return text + ("" if c.measured else ", estimated")
    return c.note if c.measured and c.note else "counted only"


# Of many recordings (a directory of traces), a rule with more findings than this is summarised in
# one line: how many, in how many recordings, and its costliest finding (each is in findings.json)
PER_RULE_LINES = 5


def finding_lines(evidence: Evidence, findings: list[Finding], brief: bool = False) -> list[Text]:
    """A line per finding (most costly first); of several recordings, a rule's findings past
    PER_RULE_LINES in one line instead, at its costliest finding's place. `brief`: finding_brief's
    line, else finding_line's (the whole message)."""
    one = finding_line
    labels = {str(t.path): t.label for t in evidence.trace_data}
    if brief:  # (finding_brief at WIDTH: brief_lines cuts at its own; one recording need not be named)
        def one(f: Finding) -> Text:
            return finding_brief(f, named=traces < 2, labels=labels)
    traces = len(evidence.trace_data) + len(evidence.snapshot_data)
    counts: dict[str, int] = {}
    for f in findings:
        counts[f.rule] = counts.get(f.rule, 0) + 1
    out: list[Text] = []
    said: set[str] = set()
    for f in findings:
        n = counts[f.rule]
        if traces < 2 or n <= PER_RULE_LINES:
            out.append(one(f))
        elif f.rule not in said:  # (the first met is the costliest: `findings` is by cost)
            said.add(f.rule)
            line = Text()
            line.append(f"{f.severity:<7}", style=SEVERITY_STYLE.get(f.severity, ""))
            line.append(" ")
            line.append(f.rule, style="bold")
            line.append(f" {n:,} findings in {recordings_of(f.rule, findings, traces)} (each in findings.json); "
                        f"the costliest: ")
            line.append_text(one(f)[8 + len(f.rule) + 1:])
            out.append(line)
    return out


def recordings_of(rule: str, findings: list[Finding], traces: int) -> str:
    """In how many of the `traces` recordings `rule` found something: the traces and snapshots its
    findings' evidence names ("12 of 2,000 recordings"), or "among" them where a finding names none."""
    named = [f.evidence.get("trace") or f.evidence.get("snapshot") for f in findings if f.rule == rule]
    if not named or not all(isinstance(n, str) for n in named):
        return f"among {traces:,} recordings"
    k = len(set(named))
    return f"{k:,} of {traces:,} recordings" if k < traces else f"all {traces:,} recordings"


def finding_line(f: Finding) -> Text:
    """One finding with its whole message and cost (`--verbose`, summary.txt)."""
    line = _finding_prefix(f)
    line.append(" ")
    line.append(f.message)
    cost = _cost(f)
    if cost:
        line.append(f" ({cost})", style="dim")
    return line


def window_cut_phrase(cut: WindowCut, peak_rss: int = 0) -> str:
    """The profiler window recorded fewer steps, or nothing, to keep within its bounds
    (auditor.capture.window_memory), with the peak resident memory read from outside the process."""
    gb = 1e9
    if cut.calibrated_on is not None:
        how = (f"a step's recording and end cost {cut.step_cost_bytes / gb:.2f} GB and {cut.step_trace_bytes / gb:.3f} "
               f"GB of trace, as measured on step {cut.calibrated_on}")
    else:
        how = f"ending a window was taken to cost {cut.factor:.1f}x what it records (no whole step measured)"
    bound = (f"--profile-memory: {cut.start_rss_bytes / gb:.2f} GB resident when the window began, at most "
             f"{cut.limit_bytes / gb:.2f} GB with its end")
    if cut.reason == "trace-size":
        bound = f"--trace-size: a trace of at most {cut.trace_limit_bytes / gb:.3f} GB"
    peak = f"; the process peaked at {peak_rss / gb:.2f} GB resident (read from outside)" if peak_rss else ""
    if cut.dropped_trace_bytes:
        return (f"profiler window kept no trace: its trace took {cut.dropped_trace_bytes / gb:.3f} GB compressed, "
                f"over --trace-size's {cut.trace_limit_bytes / gb:.3f} GB ({how}){peak}")
    if cut.nothing:
        return (f"profiler window recorded nothing: step {cut.step}'s recording and its end would pass {bound} "
                f"({how}){peak}; no trace was kept{_whole_step_advice(cut)}")
    if cut.planned:
        return (f"profiler window recorded fewer steps than planned, up to step {cut.step}, to keep within {bound} "
                f"({how}){peak}; the later steps ran unprofiled")
    return (f"profiler window ended early in step {cut.step} to keep within {bound} ({how}); it recorded until "
            f"{cut.rss_bytes / gb:.2f} GB{peak}; the trace holds the steps recorded until then, the later steps "
            f"ran unprofiled{_whole_step_advice(cut)}")


def _whole_step_advice(cut: WindowCut) -> str:
    """What would record the cut step whole: the bound it would take (--profile-memory is in GiB),
    estimated from what was measured; with no whole step measured, a lower estimate (a larger bound
    only where that estimate passes the bound: the watch stops such a window wherever its end,
    times UNCALIBRATED_FACTOR, would pass), and a run long enough (4 steps) that its window starts
    after a step measured whole; where the window had such a step and its recording was cut too
    (`warm_up_cut`), a bound larger than this one alone."""
    if cut.need_bytes <= 0 or cut.reason != "memory":
        return ""
    gib = -(-cut.need_bytes * 100 // 2**30) / 100  # (rounded up: the flag's value that suffices)
    if cut.calibrated_on is not None:
        return (f"; recording step {cut.step} whole would take about {cut.need_bytes / 1e9:.2f} GB with its end: "
                f"--profile-memory {gib:.2f} or more")
    if cut.warm_up_cut:  # (a step before the window was recorded, and it did not fit either)
        over = max(gib, -(-(cut.limit_bytes - cut.start_rss_bytes) * 100 // 2**30) / 100)
        return (f"; recording step {cut.step} whole would take more than {cut.need_bytes / 1e9:.2f} GB with its end "
                f"(its recording until the stop, times {cut.factor:.1f}), and the warm-up step before the window did "
                f"not fit its own recording either, so a longer run records no more: --profile-memory above "
                f"{over:.2f}, where the machine has the memory")
    larger = f"--profile-memory above {gib:.2f}, or " if cut.need_bytes > cut.limit_bytes - cut.start_rss_bytes else ""
    return (f"; recording step {cut.step} whole would take more than {cut.need_bytes / 1e9:.2f} GB with its end "
            f"(its recording until the stop, times {cut.factor:.1f}): {larger}--steps 4 or more so that the window "
            f"starts after a step measured whole")


def summary_lines(evidence: Evidence, results: RuleResults, out_dir: Path | None) -> list[Text]:
    """Everything print_summary shows, as Text lines (also the plain summary.txt), each one line
    with its control characters escaped (see printable)."""
    return [printable_line(line) for line in _summary_lines(evidence, results, out_dir)]


def _summary_lines(evidence: Evidence, results: RuleResults, out_dir: Path | None) -> list[Text]:
    rec = recoverable(evidence, results)
    account = _account(evidence)
    lines = [_detailed_head(evidence, rec, account)]
    if account is not None:
        lines.append(Text(parts_line(account), style="dim"))
        if (spread := spread_line(account)) is not None:
            lines.append(Text(spread, style="dim"))
    lines.extend(_alerts(evidence, account, at_start=True))
    if rec.ms is not None and (gpu := rehearsed_share(evidence, rec.total, rec.launches_ms)) is not None:
        lines.append(Text(gpu_line(*gpu), style="dim"))
    if (clock := clock_phrase(evidence)) is not None:
        lines.append(Text(clock, style="dim"))
    if (longest := longest_step_phrase(evidence)) is not None:
        lines.append(Text(longest, style="yellow"))
    if (cost := own_cost_phrase(evidence)) is not None:
        lines.append(Text(cost, style="dim"))
    if evidence.program is not None:
        lines.append(Text(program_phrase(evidence), style="dim"))
    lines.extend(_alerts(evidence, account, at_start=False))
    lines.extend(_ending_lines(evidence, results))
    lines.extend(Text(a, style="dim") for a in allocator_lines(evidence))
    lines.extend(Text(a, style="yellow") for a in left_out_lines(evidence))
    if results.findings:
        lines.extend(finding_lines(evidence, by_cost(results.findings)))
    else:
        lines.append(Text("no findings", style="green"))
    lines.extend(Text(f"rule {err['rule']} failed: {err['error']}", style="red") for err in results.errors)
    extras = []
    if results.skipped:
        wanting = all(s["reason"].startswith("needs ") for s in results.skipped)
        extras.append(f"{len(results.skipped)} rule(s) skipped" + (", for want of the evidence they read" if wanting else ""))
    if results.suppressed:
        extras.append(f"{results.suppressed} finding(s) suppressed")
    if extras:
        lines.append(Text(", ".join(extras) + " (see the report)", style="dim"))
    if out_dir is not None:
        written = _written(out_dir)
        report = out_dir / "report.html"
        lines.append(Text(f"report: {report if report in written else out_dir}"))
        others = [str(p) for p in written if p != report]
        if others:
            lines.append(Text("also: " + ", ".join(others), style="dim"))
    return lines


def _account(evidence: Evidence) -> Any:
    """The run's time account (auditor.evidence.run_time), or None for a checkpoint, snapshots or
    a run without one."""
    if checkpoint_overview(evidence) is not None or snapshot_overview(evidence):
        return None
    return run_time(evidence)


def _what_ran(evidence: Evidence) -> Text:
    """The head line's start: what was audited (a checkpoint, snapshots, a run's steps)."""
    ck = checkpoint_overview(evidence)
    snaps = snapshot_overview(evidence)
    if ck is not None:
        return _checkpoint_head(evidence, ck)
    if snaps:
        return Text(f"audit of memory snapshot{'s' if len(snaps) > 1 else ''} {evidence.target}: "
                    + "; ".join((f"{s['name']}: " if len(snaps) > 1 else "") + snapshot_phrase(s) for s in snaps))
    return Text(f"audit of {evidence.target or 'run'}: {len(evidence.shown_step_ms())} step(s){steps_of(evidence)}")


def _detailed_head(evidence: Evidence, rec: Recoverable, account: Any) -> Text:
    head = _what_ran(evidence)
    median = evidence.shown_median_ms()
    if account is not None:
        head.append(f", {account.base_ms:.2f} ms/step over the run")
    if median is not None:
        head.append(f", median {median:.2f} ms/step")
    if rec.ms is not None:
        head.append(f", up to {small_ms(rec.ms)} ms/step recoverable")
        if rec.share is not None:
            head.append(f" ({rec.share:.0%})")
        head.append(" by the warnings' fixes together")
        if rec.capped:  # (their costs add up past what the run can lose)
            head.append(" (less than the sum of their costs, which overlap)")
        if rec.estimated:
            head.append(", partly estimated")
    if rec.elsewhere:
        head.append(f"; {elsewhere_phrase(rec.elsewhere)}")
    return head


def _alerts(evidence: Evidence, account: Any, at_start: bool) -> list[Text]:
    """The lines that say a run's figures are weak or its steps unlike a plain run's: too few
    timed steps (`at_start`); no GPU work in a rehearsal, processes the program started (else)."""
    if at_start:
        few = too_few_line(account) if account is not None else None
        return [Text(few, style="yellow")] if few is not None else []
    said = [no_gpu_work_phrase(evidence), started_processes_phrase(evidence)]
    return [Text(a, style="yellow") for a in said if a is not None]


def _ending_lines(evidence: Evidence, results: RuleResults) -> list[Text]:
    """How a run that did not complete ended and where it raised, and what the profiler window
    lost (dropped, cut short)."""
    lines: list[Text] = []
    e = evidence.ending
    if e.status != "completed":
        end = Text("run ended: ", style="bold red")
        end.append(e.status + (f" in step {e.step}" if e.step is not None else ""))
        # (a run a signal stopped says so in a sentence of its own, naming what the program raised)
        named = e.exception if e.exception and not (e.message or "").startswith("stopped by ") else ""
        if named or e.message:
            end.append(f": {named}{': ' if named and e.message else ''}{e.message or ''}")
        lines.append(end)
        if e.audit_cause:  # (the audit's rehearsal broke the run, not the program)
            lines.append(Text(e.audit_cause, style="yellow"))
        if not evidence.environment.rehearsal and any(m in (e.message or "") for m in NO_GPU_ERRORS):
            lines.append(Text("the program asks for a GPU and this machine has none: `audit run --rehearse` runs it "
                              "as CUDA code on the CPU (what it computes unchanged) and judges it as on a GPU",
                              style="yellow"))
        if e.where is not None and e.where.file:  # (where it raised, as a plain run's traceback ends)
            lines.append(Text(f"  at {_short_path(e.where.file)}:{e.where.line}"
                              + (f": {e.where.code}" if e.where.code else ""), style="dim"))
    drop = evidence.profile.drop if evidence.profile is not None else None
    if drop is not None:
        lines.append(Text(window_drop_phrase(drop, judged_without(evidence, results)), style="yellow"))
    elif (without := traces_without(evidence)) and (judged := judged_without(evidence, results)):
        lines.append(Text(traces_without_phrase(without, judged), style="yellow"))  # (said where a rule read it)
    cut = evidence.profile.cut if evidence.profile is not None else None
    if cut is not None:
        lines.append(Text(window_cut_phrase(cut, evidence.profile.peak_rss_bytes), style="yellow"))
    return lines


def _written(out_dir: Path) -> list[Path]:
    """The outputs in `out_dir` that are there and not empty, in OUTPUTS' order."""
    return [out_dir / n for n in OUTPUTS if (out_dir / n).is_file() and (out_dir / n).stat().st_size]


# The widest line the default summary prints where the terminal's width is not known (a pipe, a CI
# log): ruff's and py-spy's lines fit a terminal; a longer one is cut, never wrapped mid-finding.
WIDTH = 120
# The findings the default summary lists one a line; the others are counted (each is in the report).
BRIEF_FINDINGS = 12


def brief_lines(evidence: Evidence, results: RuleResults, out_dir: Path | None, width: int = WIDTH) -> list[Text]:
    """The default summary: at most three lines on the run (what ran; its time per step and its
    split; what the fixes give back), the lines that say it went wrong, then one line a finding
    (finding_brief), each no wider than `width`. `--verbose` prints summary_lines instead."""
    rec = recoverable(evidence, results)
    account = _account(evidence)
    lines = []
    if account is not None:
        lines.append(Text(parts_line(account), style="dim"))
    if (gains := gains_line(evidence, rec)) is not None:
        lines.append(Text(gains))
    # (the head names the target: a path is not wrapped)
    out = [printable_line(_brief_head(evidence))] + _fitted([printable_line(line) for line in lines], width)
    # (what went wrong is printed whole, each a line: a cut would lose it, a wrap would split a grep)
    alerts = _alerts(evidence, account, at_start=True)
    if (longest := longest_step_phrase(evidence)) is not None:
        alerts.append(Text(longest, style="yellow"))
    alerts += _alerts(evidence, account, at_start=False) + _ending_lines(evidence, results)
    alerts += [Text(a, style="yellow") for a in left_out_lines(evidence)]
    out += [printable_line(line) for line in alerts]
    findings = by_cost(results.findings)
    shown = finding_lines(evidence, findings[:BRIEF_FINDINGS], brief=True)
    out.extend(_cut(printable_line(line), width) for line in shown)
    if len(findings) > BRIEF_FINDINGS:
        out.append(Text(f"and {len(findings) - BRIEF_FINDINGS} more finding(s) in the report", style="dim"))
    if not findings:
        out.append(Text("no findings", style="green"))
    tail = [Text(f"rule {err['rule']} failed: {err['error']}", style="red") for err in results.errors]
    if results.suppressed:
        tail.append(Text(f"{results.suppressed} finding(s) suppressed by the config", style="dim"))
    if out_dir is not None:
        written = _written(out_dir)
        report = out_dir / "report.html"
        tail.append(Text(f"report: {report if report in written else out_dir}"))
        if others := [p.name for p in written if p != report]:
            tail.append(Text("also there: " + ", ".join(others), style="dim"))
    return out + [printable_line(line) for line in tail]


def _cut(line: Text, width: int) -> Text:
    """`line` cut to `width` with an ellipsis: a finding's line is one line (its message is whole
    in the report)."""
    line = line.copy()
    line.truncate(width, overflow="ellipsis")
    return line


def _fitted(lines: list[Text], width: int) -> list[Text]:
    """Each line wrapped at words to `width` (a summary line is not cut: what is past the width
    would be lost)."""
    console = Console(width=width, highlight=False, emoji=False)
    out: list[Text] = []
    for line in lines:
        out.extend(line.wrap(console, width) if len(line.plain) > width else [line])
    return out


def _brief_head(evidence: Evidence) -> Text:
    head = _what_ran(evidence)
    if (median := evidence.shown_median_ms()) is not None:
        head.append(f", median {median:.1f} ms/step" if median >= 10 else f", median {median:.2f} ms/step")
    if evidence.environment.rehearsal and evidence.steps:
        head.append(", CUDA rehearsed on the CPU")
    return head


def gains_line(evidence: Evidence, rec: Recoverable) -> str | None:
    """What the warnings' fixes give back together, per step and as a share of the run's time, and
    on a rehearsal the GPU step they were predicted on; None where no warning has a time cost."""
    if rec.ms is None:
        return None
    share = f"{rec.share:.0%}" if rec.share is not None else ""
    how = ", ".join(w for w in (share, "partly estimated" if rec.estimated else "") if w)
    text = f"fixes give back up to {_short_ms(rec.ms)} ms/step" + (f" ({how})" if how else "")
    if (gpu := rehearsed_share(evidence, rec.total, rec.launches_ms)) is not None:
        predicted, saved, name = gpu
        text += f"; on an {name.removeprefix('NVIDIA ')}: {_short_ms(saved)} of a predicted {_short_ms(predicted)} ms/step"
    if rec.elsewhere:
        text += f"; {elsewhere_phrase(rec.elsewhere)}"
    return text


def _short_ms(ms: float) -> str:
    return f"{ms:.1f}" if ms >= 10 else small_ms(ms)


def finding_brief(f: Finding, width: int = WIDTH, named: bool = False, labels: dict[str, str] | None = None) -> Text:
    """One finding in one line, ruff's shape: `severity rule file:line cost sentence` (the cost per
    step and its share, `~` where estimated), the sentence its message's first (the rest is in the
    report, `--verbose` and findings.json). A path that leaves the sentence under half the `width`
    is shortened to its last two parts (`…/proj/train.py`). `named`: the audit read one recording,
    which the sentence need not name ("in x.pt.trace.json.gz"); of several, a sentence that does not
    name the finding's recording is led by its label (`labels`: trace path -> label)."""
    line = _finding_prefix(f)
    if f.locations and len(line.plain) > width // 2:
        line = _finding_prefix(f, short=True)
    if cost := _brief_cost(f):
        line.append(f" {cost}", style="bold" if f.cost and f.cost.ms_per_step is not None else "dim")
    sentence = first_sentence(f.message)
    trace = f.evidence.get("trace") if isinstance(f.evidence, dict) else None
    if named and isinstance(trace, str) and trace:
        name = re.escape(Path(trace).name)
        sentence = re.sub(rf"^In {name},? (\w)", lambda m: m[1].upper(), re.sub(rf" in {name}\b", "", sentence))
    elif not named and isinstance(trace, str) and (label := (labels or {}).get(trace)) and label not in sentence:
        sentence = f"{_short_label(label)}: {sentence}"
    line.append(" " + sentence)
    return line


def _short_label(label: str, most: int = 40) -> str:
    """A recording's label in at most about `most` characters: whole, or its last parts after `…/`."""
    if len(label) <= most:
        return label
    parts = Path(label).parts
    tail = "/".join(parts[-2:])
    return "…/" + (tail if len(tail) <= most else parts[-1])


def _finding_prefix(f: Finding, short: bool = False) -> Text:
    line = Text()
    line.append(f"{f.severity:<7}", style=SEVERITY_STYLE.get(f.severity, ""))
    line.append(" ")
    line.append(f.rule, style="bold")
    if f.locations:
        loc = f.locations[0]
        path = _short_path(loc.file)
        if short and len(Path(path).parts) > 2:
            path = "…/" + "/".join(Path(path).parts[-2:])
        line.append(f" {path}:{loc.line}", style="dim")
    return line


def _brief_cost(f: Finding) -> str:
    """The cost in a few characters: '15.4 ms 44%' (per step, share of the run's time), '~0.32 ms
    1%' (estimated), 'counted' (no time cost)."""
    c = f.cost
    if c is None:
        return ""
    if c.ms_per_step is None:
        return c.note if c.measured and c.note and len(c.note) <= 24 else "counted"
    text = ("" if c.measured else "~") + f"{_short_ms(c.ms_per_step)} ms"
    return text + (f" {c.share_of_step:.0%}" if c.share_of_step is not None else "")


# torch's errors for a GPU asked for on a machine without one (an integer device, `.cuda()`,
# `torch.cuda.*`): the ones a CUDA rehearsal answers
NO_GPU_ERRORS = ("Cannot access accelerator device when none is available", "Torch not compiled with CUDA enabled",
                 "Found no NVIDIA driver on your system", "No CUDA GPUs are available")


LONGEST_STEP_MS = 1000.0  # a step shorter than this is a first call's warm-up, not a stall to name


def longest_step_phrase(evidence: Evidence) -> str | None:
    """One step that took most of the run's step time (a 20 s stall among 30 ms steps) is said
    whether or not it was profiled or timed: the median and the findings leave it out."""
    steps = [s for s in evidence.steps if not s.failed]
    if len(steps) < 3:
        return None
    total = sum(s.ms for s in steps)
    worst = max(steps, key=lambda s: s.ms)
    rest = sorted(s.ms for s in steps if s is not worst)
    typical = rest[len(rest) // 2]
    if total <= 0 or worst.ms < LONGEST_STEP_MS or worst.ms < 0.5 * total or worst.ms < 10 * typical:
        return None
    return (f"step {worst.index} took {worst.ms / 1000:.2f} s, {worst.ms / total:.0%} of all the steps' time "
            f"(the other steps' median: {typical:.2f} ms{'; it was profiled' if worst.profiled else ''})")


def left_out_lines(evidence: Evidence) -> list[str]:
    """One line for the recorded values the loaders left out as impossible (a trace's events with
    no time, a negative or week-long duration, a word for a number; a snapshot's entries of sizes
    no device has): how many, and of what. They change the findings, so the summary says so."""
    dropped = [(t.label, t.dropped) for t in evidence.trace_data if getattr(t, "dropped", "")]
    dropped += [(Path(s.path).name, s.dropped) for s in evidence.snapshot_data if getattr(s, "dropped", "")]
    if not dropped:
        return []
    label, text = dropped[0]
    if len(dropped) == 1:
        return [f"{label}: {text}"]
    return [f"left out: values in {len(dropped)} recordings (the first, {label}: {text}; the report lists each)"]


def default_console() -> Console:
    """Plain when not a TTY (rich's own detection), no wrapping, no guessing highlights."""
    return Console(highlight=False, soft_wrap=True, emoji=False)


def print_summary(evidence: Evidence, results: RuleResults, out_dir: Path | None,
                  console: Console | None = None, verbose: bool = False) -> None:
    """brief_lines fitted to the terminal's width (WIDTH where that is not known: a pipe, a file);
    `verbose`: summary_lines, today's detail, each line whole."""
    console = console or default_console()
    if verbose:
        lines = summary_lines(evidence, results, out_dir)
    else:
        lines = brief_lines(evidence, results, out_dir, console.width if console.is_terminal else WIDTH)
    for line in lines:
        console.print(line)


class TerminalSummary(Reporter):
    """summary.txt: the terminal lines as plain text, kept next to the other outputs."""

    name = "terminal"
    filename = "summary.txt"

    def render(self, evidence: Evidence, results: RuleResults, out_dir: Path) -> str:
        return "".join(line.plain + "\n" for line in summary_lines(evidence, results, out_dir))
