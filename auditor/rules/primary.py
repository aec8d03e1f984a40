"""The rules on a job of ranks whose driver holds the primary rank's traces as sketches
(auditor.evidence.ranks.sketch): the rules read a trace's events, so they run in a process of their
own (auditor.evidence.ranks.engines.in_child) that parses the primary rank's traces again, attaches
them to the same Evidence (the driver's, with every rank's summary merged into Evidence.ranks) and
runs the same rule engine with the same configuration. Only the results travel back (PrimaryRules),
with what the reports read of the traces that a sketch cannot hold (their efficiency tables), and
the parsed traces end with that process: the driver's memory never holds a trace's events.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from auditor.config import Config
from auditor.evidence import model as m
from auditor.evidence.trace.efficiency import Efficiency
from auditor.findings import Finding, RuleResults


class PrimaryRules(msgspec.Struct):
    """The rule engine's results on the primary rank's traces (RuleResults' fields), and each
    trace's efficiency table for the `--device` chosen (None: a trace without GPU work), which the
    reports read (auditor.evidence.trace.efficiency)."""

    findings: list[Finding] = []
    skipped: list[dict[str, str]] = []
    errors: list[dict[str, str]] = []
    suppressed: int = 0
    efficiency: list[Efficiency | None] = []


def has_sketches(evidence: m.Evidence) -> bool:
    """Whether the evidence's traces are sketches (a job of ranks' driver holds them so)."""
    from auditor.evidence.ranks.sketch import SketchTrace

    return any(isinstance(t, SketchTrace) for t in evidence.trace_data)


def rules_on_sketches(evidence: m.Evidence, config: Config,
                      run: Callable[[m.Evidence, Config], RuleResults]) -> RuleResults:
    """`run` (the rule engine's run_rules) on `evidence` whose traces are sketches: in a process of
    its own on the full traces (see the module); the sketches take the efficiency tables it sends back."""
    from auditor.evidence.ranks.engines import in_child

    traces = [(str(t.path), t.label) for t in evidence.trace_data]
    out: PrimaryRules = in_child(rules_on_traces, m.encode(evidence), traces, config, run)
    chosen = evidence.environment.device_model
    for sketch, eff in zip(evidence.trace_data, out.efficiency):
        if eff is not None:
            sketch.__dict__.setdefault("_efficiency", {})[chosen] = eff
    return RuleResults(findings=list(out.findings), skipped=list(out.skipped), errors=list(out.errors),
                       suppressed=out.suppressed)


def rules_on_traces(encoded: bytes, traces: list[tuple[str, str]], config: Config,
                    run: Callable[[m.Evidence, Config], RuleResults]) -> PrimaryRules:
    """(In the child.) The Evidence `encoded` with the traces at `traces` (path, label) parsed and
    attached, and the rule engine (`run`) run on it."""
    import numpy as np

    from auditor.evidence.errors import InputError
    from auditor.evidence.trace.decode import GPU_WORK
    from auditor.evidence.trace.efficiency import efficiency
    from auditor.evidence.trace.load import load_trace

    evidence = m.decode(encoded)
    parsed: list[Any] = []
    for path, label in traces:
        try:
            trace = load_trace(path)
        except InputError as e:  # (its sketch was made from it: changed since)
            raise InputError(f"the primary rank's trace changed while it was analysed: {e}") from None
        trace.label = label
        parsed.append(trace)
    evidence.__dict__["trace_data"] = parsed
    evidence.__dict__["snapshot_data"] = []
    results = run(evidence, config)
    chosen = evidence.environment.device_model
    effs = [efficiency(t, chosen) if np.isin(t.col("cat"), GPU_WORK).any() else None for t in parsed]
    return PrimaryRules(findings=results.findings, skipped=results.skipped, errors=results.errors,
                        suppressed=results.suppressed, efficiency=effs)
