"""The headline's "up to X ms/step recoverable" on recorded traces: findings whose costs are the
same time are summed once. host-sync's trace cost is the GPU's idle time while the host waited,
which gpu-idle's idle total already holds when both judge the same trace. Expected numbers come
from the raw JSON (gzip + json), through the helpers of test_trace_rules."""
from __future__ import annotations

import statistics

import msgspec
import pytest

from auditor.evidence.load import load_paths
from auditor.evidence.model import Evidence
from auditor.reports.findings_json import document
from auditor.reports.html import verdict
from auditor.reports.terminal import recoverable, summary_lines
from auditor.rules.engine import RuleResults, run_rules
from test_trace_rules import DDP, RANK0, TRACES, in_steps, raw, raw_blocking, raw_idle, raw_idle_behind, raw_steps

pytestmark = pytest.mark.skipif(not TRACES.is_dir(), reason=f"recorded fixtures not found at {TRACES}")

_RUNS: dict[str, tuple[Evidence, RuleResults]] = {}


def analysed(name: str) -> tuple[Evidence, RuleResults]:
    """The evidence and every registered rule's findings, as `audit analyze` makes them (once per trace)."""
    if name not in _RUNS:
        ev = load_paths([TRACES / name])
        _RUNS[name] = (ev, run_rules(ev))
    return _RUNS[name]


def raw_idle_per_step_ms(name: str) -> float:
    _, idle_us, _ = raw_idle(raw(name))
    return idle_us / 1000 / len(raw_steps(name))


@pytest.mark.parametrize("name", [DDP, RANK0])
def test_host_sync_idle_is_not_added_to_gpu_idle_in_the_headline(name: str) -> None:
    """DDP rank 0 used to read 174.88 = gpu-idle 169.91 + host-sync 4.97; A100 rank 0 summed past the
    step and was capped. The headline is gpu-idle's idle time: host-sync's is part of it."""
    ev, results = analysed(name)
    by_rule = {f.rule: f for f in results.findings}
    assert set(by_rule) == {"gpu-idle", "host-sync"} and len(results.findings) == 2  # nothing else to add
    idle = raw_idle_per_step_ms(name)
    assert by_rule["gpu-idle"].cost.ms_per_step == pytest.approx(idle, abs=1e-3)
    # host-sync's own cost is unchanged (other tools read it): the idle time behind its waits ...
    waits = in_steps(name, raw_blocking(raw(name)))
    behind = raw_idle_behind(name, waits) / 1000 / len(raw_steps(name))
    sync = by_rule["host-sync"].cost
    assert sync.ms_per_step == pytest.approx(behind, abs=1e-3) and sync.ms_per_step > 1.0
    # ... and left out of the sum, gpu-idle's holding it
    rec = recoverable(ev, results)
    median = statistics.median(b - a for a, b in raw_steps(name)) / 1000
    assert ev.shown_median_ms() == pytest.approx(median, abs=1e-3)
    assert rec.ms == pytest.approx(idle, abs=1e-3) and not rec.capped
    assert rec.share == pytest.approx(idle / median, abs=1e-4)
    head = summary_lines(ev, results, None)[0].plain
    assert f", up to {by_rule['gpu-idle'].cost.ms_per_step:.2f} ms/step recoverable ({idle / median:.0%})" in head
    page = verdict(ev, results)
    assert page["recoverable_share"] == f"{idle / median:.0%}" and not page["capped"]
    assert page["recoverable_ms"] == verdict(ev, RuleResults(findings=[by_rule["gpu-idle"]]))["recoverable_ms"]
    assert sync.within == "gpu-idle" and by_rule["gpu-idle"].cost.within is None


def test_a_contained_cost_counts_when_its_container_is_absent_or_elsewhere() -> None:
    """host-sync's idle time is left out only beside a gpu-idle finding on the same trace: with
    gpu-idle quiet (below its threshold, or ignored) or judging another trace, it is the saving."""
    ev, results = analysed(DDP)
    by_rule = {f.rule: f for f in results.findings}
    sync, idle = by_rule["host-sync"], by_rule["gpu-idle"]
    alone = recoverable(ev, RuleResults(findings=[sync]))
    assert alone.ms == pytest.approx(sync.cost.ms_per_step)
    other = msgspec.structs.replace(idle, evidence={**idle.evidence, "trace": str(TRACES / RANK0)})
    both = recoverable(ev, RuleResults(findings=[other, sync]))
    assert both.ms == pytest.approx(idle.cost.ms_per_step + sync.cost.ms_per_step)


def test_findings_json_keeps_the_costs_and_names_the_container() -> None:
    """findings.json's per-finding costs are what they were; `within` is the one key added."""
    ev, results = analysed(DDP)
    doc = document(ev, results)
    costs = {f["rule"]: f["cost"] for f in doc["findings"]}
    assert set(costs["host-sync"]) == {"ms_per_step", "share_of_step", "measured", "note", "within"}
    assert costs["host-sync"]["within"] == "gpu-idle" and costs["gpu-idle"]["within"] is None
    waits = in_steps(DDP, raw_blocking(raw(DDP)))
    assert costs["host-sync"]["ms_per_step"] == pytest.approx(
        raw_idle_behind(DDP, waits) / 1000 / len(raw_steps(DDP)), abs=1e-3)
