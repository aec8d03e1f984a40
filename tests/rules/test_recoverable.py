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
from auditor.rules.engine import run_rules
from auditor.findings import RuleResults
from raw_gaps import per_step as raw_causes
from test_trace_rules import BERT, DDP, RANK0, TRACES, raw, raw_idle, raw_op_calls, raw_steps, raw_sync_cost


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


def raw_claim_per_step_ms(name: str) -> float:
    """gpu-idle's cost: the idle the host caused (queued-work and untraced idle left out)."""
    causes = raw_causes(str(TRACES / name))
    return sum(causes[c] for c in ("host synchronisation", "data loading", "host work", "launch"))


def raw_sync_saving_per_step_ms(name: str) -> float:
    calls = [c for groups in raw_op_calls(name).values() for c in groups]
    return raw_sync_cost(name, calls)[1] / 1000 / len(raw_steps(name))


def raw_base_ms(name: str) -> float:
    """The recording's time per step: its steps' span over their number (what every share is of)."""
    steps = raw_steps(name)
    return (max(b for _, b in steps) - min(a for a, _ in steps)) / 1000 / len(steps)


def raw_busy_per_step_ms(name: str) -> float:
    window, idle_us, _ = raw_idle(raw(name))
    return (window - idle_us) / 1000 / len(raw_steps(name))


@pytest.mark.parametrize("name", [DDP, RANK0])
def test_idle_is_counted_once_by_the_finding_that_names_its_cause(name: str) -> None:
    """DDP rank 0 used to read 174.88 = gpu-idle 169.91 + host-sync 4.97, then gpu-idle's 169.3 ms
    of idle the host caused with host-sync and launch-bound inside it. Now each cause's idle is
    counted by the finding naming it, up to what that finding's fix saves (launch-bound's 117.2 ms
    of launch-starved gaps, host-sync's waits), and gpu-idle keeps the rest: the costs add up to
    the raw idle the host caused, and nothing is held inside gpu-idle any more. On RANK0 the step is
    device-bound (375 ms on the device's clock against 216 on the host's): host-side fixes save
    nothing, whatever idle they explain."""
    ev, results = analysed(name)
    by_rule = {f.rule: f for f in results.findings}
    assert len(by_rule) == len(results.findings)  # one finding per rule here
    assert not any(f.cost.within == "gpu-idle" for f in results.findings)
    idle = by_rule["gpu-idle"]
    explained = idle.evidence["explained_by_ms_per_step"]
    claim = raw_claim_per_step_ms(name)
    assert idle.evidence["recoverable_ms_per_step"] == pytest.approx(claim, abs=2e-3)
    assert idle.evidence["unexplained_ms_per_step"] == pytest.approx(claim - sum(explained.values()), abs=2e-3)
    sync = by_rule["host-sync"]
    own = sync.evidence.get("own_ms_per_step", sync.evidence.get("measured_ms_per_step", sync.cost.ms_per_step))
    assert own == pytest.approx(raw_sync_saving_per_step_ms(name), abs=1e-3)  # (its waits)
    # a warning as the rule found it (RANK0's; DDP's is info) takes the whole idle its syncs leave
    # until the next launch; then severity follows that cost (0.86 ms, 0.4% of the step: info)
    assert sync.severity == "info" and ("idle_ms_per_step" in sync.evidence) == (name == RANK0)
    if name == RANK0:
        assert explained["host-sync"] == pytest.approx(raw_causes(str(TRACES / name))["host synchronisation"], abs=2e-3)
        assert sync.evidence["idle_ms_per_step"] == pytest.approx(explained["host-sync"], abs=1e-3)
        assert sync.evidence["idle_ms_per_step"] > own
    else:  # an info finding, up to its own cost
        assert explained["host-sync"] == pytest.approx(own, abs=1e-3)
    # (each step on its bound's clock: RANK0's is the device's span, longer than its ProfilerStep)
    median = ev.shown_median_ms()
    rec = recoverable(ev, results)
    warned = [f for f in results.findings if f.severity == "warning"]
    if name == DDP:  # host-bound: every host-side cost counts in full, up to the step less the GPU's work
        launch = by_rule["launch-bound"]
        assert explained["launch-bound"] == pytest.approx(launch.cost.ms_per_step, abs=1e-3)
        assert idle.cost.ms_per_step == pytest.approx(claim - sum(explained.values()), abs=2e-3)
        assert idle.severity == "info"  # (what is left is under min-idle-share of the step)
        # (device-side: at most the device's work the host waits for in its syncs)
        comm = by_rule["exposed-comm"]
        from auditor.evidence.step_clock import step_clock

        assert comm.cost.ms_per_step <= step_clock(ev, ev.trace_data[0]).waited_ms + 1e-3
        assert rec.ms == pytest.approx(launch.cost.ms_per_step + comm.cost.ms_per_step, abs=1e-3)
    else:  # host-bound too: its kernels work ~76 ms of a ~216 ms ProfilerStep, so host-side fixes count
        from auditor.evidence.step_clock import step_clock

        clock = step_clock(ev)
        assert clock.bound == "host" and "device-bound" not in sync.message
        assert median == pytest.approx(clock.host_ms, abs=1e-6)
        assert rec.ms == pytest.approx(sum(f.cost.ms_per_step for f in warned), abs=1e-3)
        assert rec.ms <= raw_base_ms(name) - clock.device_busy_ms
    base = raw_base_ms(name)  # (the run's time per step: the share's basis)
    assert rec.share == pytest.approx(rec.ms / base, abs=1e-4) and not rec.capped
    head = summary_lines(ev, results, None)[0].plain
    assert f", up to {rec.ms:.2f} ms/step recoverable ({rec.ms / base:.0%}) by the warnings' fixes together" in head
    page = verdict(ev, results)
    assert page["recoverable_share"] == f"{rec.ms / base:.0%}" and not page["capped"]


def test_a_contained_cost_counts_when_its_container_is_absent_or_elsewhere() -> None:
    """host-sync's idle time is left out only beside a gpu-idle finding on the same trace: with
    gpu-idle quiet (below its threshold, or ignored) or judging another trace, it is the saving."""
    ev, results = analysed(DDP)
    by_rule = {f.rule: f for f in results.findings}
    idle = msgspec.structs.replace(by_rule["gpu-idle"], severity="warning")
    sync = msgspec.structs.replace(by_rule["host-sync"], severity="warning", cost=msgspec.structs.replace(
        by_rule["host-sync"].cost, within="gpu-idle", ms_per_step=1.0))
    held = recoverable(ev, RuleResults(findings=[idle, sync]))
    assert held.ms == pytest.approx(idle.cost.ms_per_step)
    alone = recoverable(ev, RuleResults(findings=[sync]))
    assert alone.ms == pytest.approx(sync.cost.ms_per_step)
    other = msgspec.structs.replace(idle, evidence={**idle.evidence, "trace": str(TRACES / RANK0)})
    both = recoverable(ev, RuleResults(findings=[other, sync]))
    # (the other trace's idle time is per step of that trace: not in this headline's sum)
    assert both.ms == pytest.approx(sync.cost.ms_per_step) and both.elsewhere == 1


def test_findings_json_keeps_the_measured_cost_beside_what_the_fix_saves() -> None:
    """findings.json's cost is what the fix saves; a cost the step's bound cut says what was
    measured (evidence `measured_ms_per_step`, the bound) and keeps the `within` key."""
    ev, results = analysed(RANK0)
    doc = document(ev, results)
    sync = next(f for f in doc["findings"] if f["rule"] == "host-sync")
    assert set(sync["cost"]) == {"ms_per_step", "share_of_step", "measured", "note", "within"}
    # (its waits took 0.44 ms; the idle they left until the host's next launch, 0.86, is what its fix
    # saves on this host-bound step: its cost, with its own measure kept beside it; 0.2% of the
    # step, so info: severity follows cost, auditor.rules.engine.graded)
    assert sync["evidence"]["own_ms_per_step"] == pytest.approx(raw_sync_saving_per_step_ms(RANK0), abs=1e-3)
    assert sync["cost"]["ms_per_step"] == pytest.approx(raw_causes(str(TRACES / RANK0))["host synchronisation"],
                                                        abs=2e-3)
    assert sync["severity"] == "info" and sync["cost"]["share_of_step"] < 0.005


def two_run_logdir(root, a: str, b: str):
    """A TensorBoard logdir of two runs, each holding one of the recorded traces (byte copies)."""
    import shutil

    for run, name in (("run-a", a), ("run-b", b)):
        (root / "tb" / run).mkdir(parents=True)
        shutil.copyfile(TRACES / name, root / "tb" / run / name)
    return root / "tb"


def test_the_headline_adds_up_only_the_trace_whose_steps_it_shows(tmp_path) -> None:
    """Two traces in one logdir: their costs are each per step of its own recording. The headline
    (DDP's 3 steps, median 222 ms) used to add BERT's 4.1 ms gpu-idle to DDP's 169.9 ms; a
    directory of all the recordings said 'the largest alone is 644 ms/step (290%)', OWL's idle time
    against DDP's step."""
    ev = load_paths([two_run_logdir(tmp_path, DDP, BERT)])
    results = run_rules(ev)
    idle = {f.evidence["trace"].split("/")[-2]: f for f in results.findings if f.rule == "gpu-idle"}
    # (BERT's small step is host-bound: its gpu-idle counts no time, its host-sync costs do)
    assert set(idle) == {"run-a", "run-b"} and idle["run-b"].evidence["verdict"] == "host-bound"
    median = statistics.median(b - a for a, b in raw_steps(DDP)) / 1000
    rec = recoverable(ev, results)
    # DDP's own warnings: launch-bound's launch-starved idle (gpu-idle's unexplained rest is info,
    # and exposed-comm too: on this host-bound step its fix saves nothing, so it is no warning)
    own = [f for f in results.findings if f.evidence["trace"].split("/")[-2] == "run-a" and f.severity == "warning"]
    total = sum(f.cost.ms_per_step for f in own)
    assert {f.rule for f in own} == {"launch-bound"}
    [comm] = [f for f in results.findings if f.rule == "exposed-comm" and f.evidence["trace"].split("/")[-2] == "run-a"]
    assert comm.severity == "info" and comm.cost.ms_per_step == 0
    assert rec.ms == pytest.approx(total, abs=1e-3) and not rec.capped
    assert rec.share == pytest.approx(total / raw_base_ms(DDP), abs=1e-4)
    assert rec.elsewhere == 1
    head = summary_lines(ev, results, None)[0].plain
    assert head.startswith(f"audit of {tmp_path / 'tb'}: 3 step(s) in run-a/{DDP}, {raw_base_ms(DDP):.2f} ms/step over "
                           f"the run, median {median:.2f} ms/step")
    assert (f", up to {rec.ms:.2f} ms/step recoverable ({rec.share:.0%}) by the warnings' fixes together; "
            "findings on 1 other trace not added in "
            f"(their costs are per step of their own trace)") in head
    page = verdict(ev, results)
    assert page["recoverable_ms"] == verdict(ev, RuleResults(findings=[idle["run-a"], *own]))["recoverable_ms"]
    assert page["steps_of"] == f" in run-a/{DDP}" and page["elsewhere"].startswith("findings on 1 other trace")

    one = load_paths([TRACES / DDP])  # the clean case: one trace, nothing left out, nothing said
    rec_one = recoverable(one, run_rules(one))
    assert rec_one.ms == pytest.approx(rec.ms) and rec_one.elsewhere == 0
    assert " in " not in summary_lines(one, run_rules(one), None)[0].plain.split(": ", 1)[1].split(",")[0]


def test_a_directory_of_unrelated_traces_keeps_its_headline_within_its_step() -> None:
    ev = load_paths([TRACES])
    results = run_rules(ev)
    shown = next(t for t in ev.trace_data if len(t.steps))  # (the trace whose steps the headline shows)
    rec = recoverable(ev, results)
    assert shown.label == DDP and ev.shown_median_ms() == pytest.approx(
        statistics.median(b - a for a, b in raw_steps(DDP)) / 1000, abs=1e-3)
    mine = [f for f in results.findings if f.evidence.get("trace") == str(shown.path) and f.cost.within is None
            and f.severity == "warning"]
    assert rec.ms == pytest.approx(sum(f.cost.ms_per_step for f in mine)) and rec.share < 1
    others = {f.evidence["trace"] for f in results.findings if f.cost and f.cost.ms_per_step
              and f.evidence.get("trace") != str(shown.path)}
    assert rec.elsewhere == len(others) >= 4


def test_a_trace_given_beside_a_run_is_not_added_to_the_run(example_audit, tmp_path) -> None:
    """`audit analyze RUN_DIR trace.json`: the run's headline is the run's; the GPU trace's 170 ms
    of idle time was added to (and capped at) a CPU run's 40 ms step."""
    from conftest import audit

    run = example_audit("dataloader_bound")  # (30 steps: the session's audit of it, test_examples' too)
    assert run.returncode == 0, run.stderr
    alone = run.findings_doc
    both = audit("analyze", str(run.out), str(TRACES / DDP), out=tmp_path / "both")
    assert both.returncode == 0, both.stderr
    ev = load_paths([run.out, TRACES / DDP])
    results = run_rules(ev)
    rec = recoverable(ev, results)
    own = [f for f in results.findings if "trace" not in f.evidence and f.cost and f.cost.ms_per_step]
    from auditor.evidence.run_time import run_time

    # (to 3 decimals; never more than the run's time per step)
    assert own and rec.ms == pytest.approx(min(sum(f.cost.ms_per_step for f in own), run_time(ev).base_ms), abs=1e-3)
    assert rec.elsewhere == 1
    assert any(f["rule"] == "gpu-idle" for f in both.findings) and not any(f["rule"] == "gpu-idle" for f in alone["findings"])
    head = (both.out / "summary.txt").read_text().splitlines()[0]  # (the whole head: --verbose's)
    assert f"up to {rec.ms:.2f} ms/step recoverable" in head and "findings on 1 other trace not added in" in head


def test_the_fixes_together_save_at_most_the_step_less_the_devices_work(tmp_path) -> None:
    """ResNet with num_workers=0: dataloader-bound, launch-bound, pageable-copy add up to 78.6 ms of
    host time on a 176 ms host-bound step whose GPU works 98 ms of it. The terminal said 'the largest
    alone is 76.89 ms/step (44%)', the page's card once 'up to 176.3 ms (100%)'. Now both give one
    figure: the run's time per step less those savings, never under the GPU's own work (its floor)."""
    import re

    from auditor.reports.html import HtmlReport
    from test_trace_rules import W0

    ev, results = analysed(W0)
    rec = recoverable(ev, results)
    median = statistics.median(b - a for a, b in raw_steps(W0)) / 1000
    base = raw_base_ms(W0)
    from auditor.evidence.step_clock import step_clock

    busy = step_clock(ev, ev.shown_trace()).device_busy_ms  # (the GPU's work per ProfilerStep, in its host span)
    assert 90 < busy < 105
    warned = [f for f in results.findings if f.severity == "warning"]
    assert {f.rule for f in warned} == {"dataloader-bound", "launch-bound", "pageable-copy"}
    total = sum(f.cost.ms_per_step for f in warned)
    assert total > base - busy  # (their sum would take the run below the GPU's work)
    assert rec.capped and rec.ms == pytest.approx(base - busy, abs=0.01)
    assert ev.shown_median_ms() == pytest.approx(median, abs=1e-3)
    head = summary_lines(ev, results, None)[0].plain
    assert (f"up to {rec.ms:.2f} ms/step recoverable ({rec.ms / base:.0%}) by the warnings' fixes together "
            "(less than the sum of their costs, which overlap)") in head
    page = HtmlReport().render(ev, results, tmp_path)
    card = re.search(r'<div class="label">Recoverable per step</div>(.*?)</div>\s*</div>', page, re.S).group(1)
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", card)).strip()
    assert text.startswith(f"up to {rec.ms:.1f} ms ({rec.ms / base:.0%}) what the warnings' fixes together save"), text
    assert "100%" not in text and "largest" not in text


def test_launch_bounds_text_and_cost_agree_and_leave_the_devices_work() -> None:
    """launch-bound said 'waited on kernel launches 21.2 ms per step (68% of the median step)' of a
    12.95 ms step, and '9.9 ms (51%)' beside a 66.8% cost. Its printed share is its cost over the
    run's time per step, and its cost at most that less the GPU's own work per step."""
    from conftest import printed_figures

    ev, results = analysed(DDP)
    f = next(f for f in results.findings if f.rule == "launch-bound")
    base = raw_base_ms(DDP)
    ms, share = printed_figures(r"waited on kernel launches ([\d.]+) ms per step \((\d+)% of the run's time\)",
                                f.message)
    assert ms == pytest.approx(f.cost.ms_per_step, abs=0.05) and share == round(100 * f.cost.ms_per_step / base)
    assert f.cost.share_of_step == pytest.approx(f.cost.ms_per_step / base, abs=1e-4)
    assert f.cost.ms_per_step <= base - f.evidence["busy_ms_per_step"]
    assert f.evidence["busy_ms_per_step"] == pytest.approx(raw_busy_per_step_ms(DDP), abs=0.01)
