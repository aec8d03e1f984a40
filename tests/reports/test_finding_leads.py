"""Each finding opens with one short sentence of what is wrong and what to do ("Steps wait for
data: load it in DataLoader workers."), the sentence the terminal line, the report's row and
SARIF's text show; the measured detail follows it. Judged on examples other tests audit too (the
session shares their runs): run rules, trace rules and numerics rules."""
from __future__ import annotations

import re

from auditor.reports.base import detail_of, first_sentence

LEAD = 80  # characters at most: the terminal line fits it beside severity, rule, place and cost


def _check(findings: list[dict]) -> None:
    assert findings
    for f in findings:
        lead, rest = first_sentence(f["message"]), detail_of(f["message"])
        # one sentence, "what: what to do.", and the measured text after it
        assert len(lead) <= LEAD, (f["rule"], lead)
        assert re.fullmatch(r"[^:]+: [^:]+\.", lead), (f["rule"], lead)
        assert rest and rest[0] in "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789(", (f["rule"], f["message"])


def _findings_of(audit_of, names: tuple[str, ...]) -> list[dict]:
    """Every finding of the session's audits of the examples `names`, each run asserted to succeed."""
    found = []
    for name in names:
        a = audit_of(name)
        assert a.returncode == 0, a.stderr[-2000:]
        found += a.findings
    return found


def test_run_rules_open_with_what_and_what_to_do(example_audit):
    found = _findings_of(example_audit, ("peak_stats_reset", "graph_leak", "dataloader_bound"))
    assert {"peak-stats-reset", "graph-leak", "dataloader-bound"} <= {f["rule"] for f in found}
    _check(found)


def test_numerics_rules_open_with_what_and_what_to_do(numerics_audit):
    found = _findings_of(numerics_audit, ("numerics_lr_resume", "numerics_amp_unscaled", "numerics_zero_grad"))
    assert {"lr-schedule", "amp-unscaled", "zero-gradients"} <= {f["rule"] for f in found}
    _check(found)
