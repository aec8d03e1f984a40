"""Runs the enabled rules over the evidence, applies suppression comments, ranks findings."""
from __future__ import annotations

import gc
import time
import traceback
from pathlib import Path

import msgspec

from auditor.config import Config
from auditor.evidence.model import Evidence
from auditor.evidence.trace.efficiency import keep_reported_efficiency, reported_efficiency
from auditor.findings import Finding, RuleResults, rank_key, share_of_step, step_basis_ms
from auditor.fixes import make_patch, project_roots, refused_edit
from auditor.rules.base import EVIDENCE_KINDS, Rule
from auditor.rules.forked import judge_forked, units, worth_forking
from auditor.rules.registry import all_rules
from auditor.rules.suppression import safe_edits, suppressed_at

# How a skip names each kind of evidence a rule needs (Rule.needs).
KIND_TEXT = {
    "run": "a run (`audit run`)",
    "trace": "a profiler trace with CUDA activity",
    "snapshot": "a CUDA memory snapshot (torch.cuda.memory._dump_snapshot pickle)",
    "checkpoint": "a checkpoint (`audit checkpoint FILE`)",
}


def has_kind(evidence: Evidence, kind: str) -> bool:
    """Whether the evidence holds one kind of EVIDENCE_KINDS."""
    if kind == "trace":
        return bool(evidence.trace_data)
    if kind == "snapshot":
        return bool(evidence.snapshot_data)
    return evidence.source == kind  # a run, a checkpoint


def needs_text(needs: frozenset[str]) -> str:
    """The skip reason of a rule whose evidence holds none of the kinds it needs: "needs a run
    (`audit run`), not a recording", "needs a profiler trace with CUDA activity", "needs a run
    (`audit run`), or a checkpoint (`audit checkpoint FILE`)"."""
    text = "needs " + ", or ".join(KIND_TEXT[k] for k in EVIDENCE_KINDS if k in needs)
    return text + ", not a recording" if needs == {"run"} else text


def skip_reason(rule: Rule, evidence: Evidence) -> str | None:
    """Why `rule` cannot judge `evidence` (None: it can): the evidence holds none of the kinds the
    rule needs (said as the rule's `needs_text`, else `needs_text(rule.needs)`), or the rule's own
    `skip_reason` says what else it lacks."""
    if rule.needs and not any(has_kind(evidence, kind) for kind in rule.needs):
        return rule.needs_text or needs_text(rule.needs)
    return rule.skip_reason(evidence)


def _apply_suppression(f: Finding) -> Finding | None:
    """None when a comment silences the finding: one on its primary location (the first, which the
    terminal names). A comment on another location takes out only that location. The fix keeps
    only edits that leave suppressed statements and their comments alone (see rules.suppression)."""
    if f.locations and suppressed_at(f.locations[0].file, f.locations[0].line, f.rule):
        return None
    kept = [loc for loc in f.locations if not suppressed_at(loc.file, loc.line, f.rule)]
    fix = f.fix
    if fix is not None and fix.edits:
        edits = safe_edits(fix.edits, f.rule)
        if len(edits) != len(fix.edits):
            fix = msgspec.structs.replace(fix, edits=edits, patch=None)
    if len(kept) == len(f.locations) and fix is f.fix:
        return f
    return msgspec.structs.replace(f, locations=kept, fix=fix)


def project_edits(f: Finding, roots: list) -> Finding:
    """`f` with only the edits a patch may carry (fixes.refused_edit): none into a file outside the
    user's project, none removing a statement that calls into a library (a `trainer.fit(...)` line,
    for what the framework did inside it); the finding's config fix says what to change there."""
    if f.fix is None or not f.fix.edits:
        return f
    kept = [e for e in f.fix.edits if refused_edit(e, roots) is None]
    if len(kept) == len(f.fix.edits):
        return f
    return msgspec.structs.replace(f, fix=msgspec.structs.replace(f.fix, edits=kept, patch=None))


def _with_patch(f: Finding) -> Finding:
    """Render a finding's code edits into `fix.patch`, so each finding carries its own diff."""
    if f.fix is None or not f.fix.edits or f.fix.patch:
        return f
    patch = make_patch(f.fix.edits) or None
    return msgspec.structs.replace(f, fix=msgspec.structs.replace(f.fix, patch=patch))


def _capped(f: Finding, evidence: Evidence) -> Finding:
    """A time cost is part of the run's time it is measured in, so no more than that can be
    recovered: a cost above its step (the median step its finding names, and never more than the
    run's time per step) is capped at it, and its note says so and keeps what was measured."""
    c = f.cost
    if c is None or c.ms_per_step is None:
        return f
    basis = step_basis_ms(evidence)
    named = f.evidence.get("median_step_ms") if isinstance(f.evidence, dict) else None
    named = named if isinstance(named, (int, float)) and named > 0 else None
    step = min(filter(None, (named, basis)), default=None)
    if not step or c.ms_per_step <= step:
        return f
    what = "the step it is part of" if step == named else "the run's time per step"
    note = (f"capped at {what} ({step:.1f} ms): the {c.ms_per_step:.1f} ms/step measured exceeds it"
            + (f"; {c.note}" if c.note else ""))
    return msgspec.structs.replace(f, cost=msgspec.structs.replace(
        c, ms_per_step=round(step, 3), share_of_step=min(1.0, share_of_step(round(step, 3), basis) or 1.0),
        note=note))


class _Outcome(msgspec.Struct):
    """What judging one rule gave: its findings (suppression applied, patches rendered), or why it
    was skipped or what it raised; how many findings comments silenced; the time its skip_reason
    and its check took."""

    findings: list[Finding] = []
    skipped: dict[str, str] | None = None
    error: dict[str, str] | None = None
    suppressed: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0


def _judge(rule: Rule, rule_id: str, evidence: Evidence, config: Config, roots: list[Path]) -> _Outcome:
    """The rule's findings, or why it is skipped or what it raised."""
    started, cpu = time.perf_counter(), time.process_time()
    out = _Outcome()
    try:
        reason = skip_reason(rule, evidence)
    except Exception as e:  # a rule that cannot tell whether it applies is skipped, saying why
        reason = f"could not be judged: {type(e).__name__}: {e}"
    found: list[Finding] = []
    if reason:
        out.skipped = {"rule": rule_id, "reason": reason}
    else:
        try:
            found = list(rule.check(evidence, config.options_for(type(rule))))
        except Exception as e:  # one broken rule must not hide the others' findings
            out.error = {"rule": rule_id, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    out.seconds, out.cpu_seconds = time.perf_counter() - started, time.process_time() - cpu
    for f in found:
        kept = _apply_suppression(f)
        if kept is None:
            out.suppressed += 1
        else:
            out.findings.append(_with_patch(project_edits(_capped(kept, evidence), roots)))
    return out


def run_rules(evidence: Evidence, config: Config | None = None, timings: dict | None = None) -> RuleResults:
    """Every enabled rule on the evidence. `timings`, when given, gets each rule's time (its
    skip_reason and its check): {rule id: {"seconds": wall, "cpu_seconds": this process's CPU}}."""
    config = config or Config()
    from auditor.rules.primary import has_sketches, rules_on_sketches

    if has_sketches(evidence):  # a job of ranks' driver: the rules run where the traces are parsed
        return rules_on_sketches(evidence, config, run_rules)
    out = RuleResults()
    roots = project_roots(evidence.target)
    # No cyclic garbage collection while the rules run: a collection of the oldest generation walks
    # every object the process holds (the evidence, pandas, plotly) for the few cycles rules make,
    # which are collected once they are done.
    collecting = gc.isenabled()
    gc.disable()
    try:
        _run_each(evidence, config, timings, out, roots)
        # (graded on what each fix saves once attribution has set it: a sync's fix is given the idle
        # it leaves, a host-side fix on a device-bound step nothing)
        out.findings = graded(_attributed(evidence, config, out.findings), _gpu_step_ms(evidence))
    finally:
        if collecting:
            gc.enable()
    out.findings.sort(key=rank_key)
    return out


def _attributed(evidence: Evidence, config: Config, findings: list) -> list:
    """Costs as what each fix saves: idle counted once, each cost on the step's critical path
    (auditor.rules.attribution)."""
    from auditor.rules.attribution import attribute
    from auditor.rules.gpu_idle import GpuIdle

    rules = all_rules()
    sides = {rule_id: cls.saves_on for rule_id, cls in rules.items()}
    return attribute(evidence, findings, sides, float(config.options_for(GpuIdle).min_idle_share))


# A performance warning saves at least this share of the run's time (what prints as 1%); one that
# saves less is info: a warning is worth a person's time
MIN_WARNING_SHARE = 0.005


def graded(findings: list[Finding], gpu_step_ms: float | None = None) -> list[Finding]:
    """Severity follows cost: a performance warning whose fix saves under MIN_WARNING_SHARE of the
    run's time, or whose cost is not timed (counted only) where its rule gives no reason a user can
    act on (Rule.warns_uncounted), is info. An estimated cost of a CUDA rehearsal is a saving on
    the GPU: its share is of `gpu_step_ms`, the step predicted there (_gpu_step_ms), not of the CPU
    step measured here. Errors, info and other categories are left as found."""
    rules = all_rules()
    out = []
    for f in findings:
        cls = rules.get(f.rule)
        if f.severity == "warning" and cls is not None and cls.category == "performance" and f.cost is not None:
            share = f.cost.share_of_step
            if gpu_step_ms and f.cost.ms_per_step is not None and not f.cost.measured:
                share = f.cost.ms_per_step / gpu_step_ms
            small = f.cost.ms_per_step is not None and share is not None and share < MIN_WARNING_SHARE
            uncounted = f.cost.ms_per_step is None and not cls.warns_uncounted
            if small or uncounted:
                f = msgspec.structs.replace(f, severity="info")
        out.append(f)
    return out


def _gpu_step_ms(evidence: Evidence) -> float | None:
    """A CUDA rehearsal's step predicted on the GPU (the longer of the host's least issue time and
    the device model's kernels, auditor.evidence.step_clock), or None."""
    from auditor.evidence.step_clock import step_clock

    if not evidence.environment.rehearsal or not evidence.steps:
        return None
    c = step_clock(evidence)
    if c.source != "estimate" or not c.issue_floor_ms or c.device_ms is None:
        return None
    return max(c.issue_floor_ms, c.device_ms)


def _run_each(evidence: Evidence, config: Config, timings: dict | None, out: RuleResults, roots: list[Path]) -> None:
    rules = {rule_id: cls for rule_id, cls in all_rules().items() if config.enabled(rule_id)}

    def judge(rule_id: str) -> _Outcome:
        return _judge(rules[rule_id](), rule_id, evidence, config, roots)

    ids = list(rules)
    if worth_forking(evidence):
        outcomes, made = judge_forked(units(ids, lambda i: rules[i].shares), judge,
                                      then=lambda: reported_efficiency(evidence))
        keep_reported_efficiency(evidence, made)
    else:
        outcomes = {i: judge(i) for i in ids}
    for rule_id in ids:  # in the rules' order, however they were judged
        got = outcomes[rule_id]
        if timings is not None:
            timings[rule_id] = {"seconds": got.seconds, "cpu_seconds": got.cpu_seconds}
        if got.skipped is not None:
            out.skipped.append(got.skipped)
        if got.error is not None:
            out.errors.append(got.error)
        out.suppressed += got.suppressed
        out.findings.extend(got.findings)
