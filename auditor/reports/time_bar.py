"""The report's picture of the run's time (auditor.evidence.run_time): one bar split into its parts
(work, data, between, syncs, rest), and under it each warning's saving on the same scale, so the
first screen shows where a step's time goes and what each fix gives back."""
from __future__ import annotations

from typing import Any

from auditor.evidence.model import Evidence
from auditor.evidence.run_time import run_time
from auditor.findings import RuleResults, severity_rank
from auditor.reports.terminal import headline_scope, in_scope

# How the bar names each part (auditor.evidence.run_time.PARTS), and what it is, for its tooltip
NAMES = {"work": ("work", "the steps' own work"), "data": ("data", "waiting for the next batch"),
         "between": ("between", "time between the steps (evaluation, checkpoints, epoch starts)"),
         "syncs": ("syncs", "waiting for the device in syncs"), "rest": ("rest", "the rest of the steps' time")}
SHOWN = 0.5  # percent of the bar: a part or saving narrower than this is listed, not drawn


def time_bar(ev: Evidence, results: RuleResults, anchors: dict[int, str]) -> dict[str, Any] | None:
    """{"base": ms a step, "parts": [...], "savings": [...]}: each part's and each timed warning's
    saving (on the recording the headline shows) as a percentage of the run's time per step;
    `anchors` maps a finding's index in `results.findings` to its row. None without a run's time."""
    account = run_time(ev)
    if account is None or account.base_ms <= 0:
        return None
    base = account.base_ms
    parts = [{"name": NAMES[p.name][0], "what": NAMES[p.name][1], "ms": p.per_step_ms,
              "pct": round(100 * p.per_step_ms / base, 2), "css": p.name}
             for p in account.parts if p.name in NAMES and p.per_step_ms > 0]
    scope = headline_scope(ev)
    savings, left = [], 100.0
    for i, f in enumerate(results.findings):
        ms = f.cost.ms_per_step if f.cost is not None else None
        if ms is None or severity_rank(f.severity) < severity_rank("warning") or not in_scope(f, scope):
            continue
        pct = min(left, round(100 * ms / base, 2))  # (savings that overlap are not drawn past the bar)
        left -= pct
        savings.append({"rule": f.rule, "ms": ms, "pct": pct, "anchor": anchors.get(i, "")})
    return {"base": base, "parts": parts, "savings": sorted(savings, key=lambda s: -s["ms"]), "shown": SHOWN}
