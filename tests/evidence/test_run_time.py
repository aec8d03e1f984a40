"""The run's time (auditor.evidence.run_time): one account of the span from the first audited step's
start to the last one's end, whose parts add up to it, and the findings it gives their costs.

Programs that stall in some steps (tests/data/run_time/): a Dataset that sleeps on one index in 32
(so one batch in four waits 200 ms for its workers), an epoch loop whose two workers start again
every 8 steps, an evaluation every 4 steps and a checkpoint every 8. Recordings: a CPU trace of the
first program (recorded here, without a schedule), and two derived from the project's real GPU
recordings (tests/data/run_time/README.md): a V100 ResNet-50 whose loader stalls in one step in
four, with no ProfilerSteps, and an H200 step that issues its work, then waits for it in a sync.
What is asserted is structure that load does not move: which steps stalled, what the parts hold,
the parts' sum, the findings' presence and their costs read back from the evidence."""
from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path
from statistics import fmean

import pytest

from conftest import ROOT, audit
from auditor.capture.child import profile_plan
from auditor.capture.numerics.schedule import SHORT_RUN, TIMED_AT_LEAST, timed_block
from auditor.config import Config
from auditor.evidence.load import load_paths
from auditor.evidence.run_time import ASK_GIVES, ASK_STEPS, run_time
from auditor.evidence.step_clock import step_clock
from auditor.reports.terminal import recoverable, summary_lines
from auditor.rules.engine import run_rules

DATA = ROOT / "tests" / "data" / "run_time"
ONE = {"OMP_NUM_THREADS": "1"}


def _waits(step: dict) -> float:
    return sum(t["ms"] for t in step["tallies"] if t["kind"] in ("data-wait", "data-iter"))


def _adds_up(account: dict) -> None:
    """The parts' times are the span's, to the rounding of each part."""
    assert sum(p["ms"] for p in account["parts"]) == pytest.approx(account["span_ms"], abs=0.01 * len(account["parts"]))
    own = next(p for p in account["parts"] if p["name"] == "audit")
    assert account["base_ms"] == pytest.approx((account["span_ms"] - own["ms"]) / account["steps"], abs=2e-3)


@pytest.fixture(scope="module")
def stalled(tmp_path_factory):
    out = tmp_path_factory.mktemp("stalled")
    a = audit("run", str(DATA / "slow_samples.py"), "--steps", "40", "--", "--stall-ms", "200", out=out / "out", env=ONE)
    assert a.returncode == 0, a.stderr[-3000:]
    return a


@pytest.mark.slow
def test_stalls_in_some_steps_are_in_the_runs_time_and_in_the_cost(stalled) -> None:
    doc, ev = stalled.findings_doc, stalled.evidence
    account = doc["run_time"]
    _adds_up(account)
    waits = {s["index"]: _waits(s) for s in ev["steps"]}
    # the stalls: only the steps whose batch holds a slow sample (index 32j + 5, batch 4j), whose
    # workers had not made it yet (an audit's pause before one can hide it)
    stalls = [i for i, w in waits.items() if w > 100]
    assert len(stalls) >= 4 and all(i % 4 == 0 for i in stalls), stalls
    data = next(p for p in account["parts"] if p["name"] == "data")
    # (the waits, less any the audit's checked or profiled steps added to theirs: its own part)
    assert sum(waits.values()) * 0.95 <= data["ms"] <= sum(waits.values()) + 0.01
    assert data["per_step_ms"] > 4 * doc["steps"]["median_ms"] * 0.5  # (most of the run: the median step leaves it out)
    slow = [s for s in account["slowest"] if s["waited"].get("data", 0) > 100]
    assert slow and all(s["step"] in stalls for s in slow)
    # the audit's own work between the steps is measured and apart: its graph scans and the profiler
    own = next(p for p in account["parts"] if p["name"] == "audit")
    assert {w["name"] for w in own["what"]} >= {"step boundaries"}
    rest = next(p for p in account["parts"] if p["name"] == "rest")
    assert rest["ms"] < 0.02 * account["span_ms"]
    # dataloader-bound: the timed steps' waits per step, stalls included and named
    (f,) = stalled.rule("dataloader-bound")
    timed = [s["index"] for s in ev["steps"] if not s["profiled"] and s.get("numerics") is None]
    assert f["cost"]["ms_per_step"] == pytest.approx(fmean(waits[i] for i in timed), abs=2e-3)
    assert f["cost"]["share_of_step"] == pytest.approx(f["cost"]["ms_per_step"] / account["base_ms"], abs=1e-4)
    assert f["evidence"]["stall_ms_per_step"] > 0.5 * f["cost"]["ms_per_step"]
    assert "Most of it in stalls: " in f["message"] and " steps stalled " in f["message"]
    assert "prefetch_factor" in f["fix"]["summary"]
    # the headline counts the stalls, and is no more than the run's time
    head = (stalled.out / "summary.txt").read_text().splitlines()[0]  # (the whole head: --verbose's)
    assert f"{account['base_ms']:.2f} ms/step over the run, median " in head
    # (findings.json keeps the median to 3 places: the headline's 2 are of the unrounded figure)
    median = float(re.search(r"median ([\d.]+) ms/step", head).group(1))
    assert median == pytest.approx(doc["steps"]["median_ms"], abs=0.0051)
    assert f"up to {f['cost']['ms_per_step']:.2f} ms/step recoverable" in head
    assert f["cost"]["ms_per_step"] <= account["base_ms"]
    assert any(line.startswith(f"run's time: {account['base_ms']:.1f} ms/step (40 steps, ") for line in stalled.stdout.splitlines())


@pytest.mark.slow
def test_a_recording_of_the_stalls_has_them_in_its_headline(tmp_path) -> None:
    """The same program recorded with torch.profiler (CPU, no schedule): its steps are found from its
    loop, and the headline's data wait is the recording's loader time over its steps."""
    trace = tmp_path / "stalls.json"
    p = subprocess.run([sys.executable, str(DATA / "slow_samples.py"), "--steps", "24", "--stall-ms", "200",
                        "--record", str(trace)], capture_output=True, text=True, timeout=240, env=None)
    assert p.returncode == 0, p.stderr[-3000:]
    ev = load_paths([trace])
    results = run_rules(ev)
    account = run_time(ev)
    (f,) = [f for f in results.findings if f.rule == "dataloader-bound"]
    loader = [s["loader_ms"] for s in f.evidence["steps"]]
    assert account.steps == len(loader) >= 20
    assert f.cost.ms_per_step == pytest.approx(fmean(loader), abs=2e-3)
    assert account.part("data").per_step_ms == pytest.approx(f.cost.ms_per_step, abs=0.01)
    assert f.severity == "warning" and f.evidence["stall_ms_per_step"] > 0.5 * f.cost.ms_per_step
    rec = recoverable(ev, results)
    assert rec.ms == pytest.approx(f.cost.ms_per_step, abs=2e-3) and rec.ms <= account.base_ms
    assert [s.waited.get("data", 0) > 100 for s in account.slowest] == [True] * len(account.slowest)


@pytest.mark.slow
def test_workers_started_every_epoch_are_a_finding_with_a_patch(tmp_path) -> None:
    a = audit("run", str(DATA / "epoch_restarts.py"), "--steps", "40", out=tmp_path / "out", env=ONE)
    assert a.returncode == 0, a.stderr[-3000:]
    account = a.findings_doc["run_time"]
    _adds_up(account)
    between = next(p for p in account["parts"] if p["name"] == "between")
    epochs = next(w for w in between["what"] if w["name"] == "epoch starts")
    assert epochs["ms"] == pytest.approx(between["ms"], abs=0.01) and epochs["ms"] > 0
    (f,) = a.rule("worker-restarts")
    e = f["evidence"]
    assert e["after_steps"] == [7, 15, 23, 31] and e["workers"] == 2
    stretches = [o for o in a.evidence["outside"] if o["phase"] == "between"]
    assert e["between_ms"] == pytest.approx(sum(o["ms"] for o in stretches), abs=0.01)
    assert f["cost"]["ms_per_step"] == pytest.approx((e["between_ms"] + e["first_step_waits_ms"]) / 40, abs=2e-3)
    assert f["severity"] == "warning" and "persistent_workers=True" in f["fix"]["summary"]
    line = next(n for n, text in enumerate((DATA / "epoch_restarts.py").read_text().splitlines(), 1)
                if "expect: worker-restarts" in text)
    assert f["locations"][0]["line"] == line
    (edit,) = f["fix"]["edits"]
    assert "persistent_workers=True" in edit["lines"][0] and f["fix"]["changes_numerics"]
    assert "persistent_workers=True" in (tmp_path / "out" / "fixes.patch").read_text()

    # the clean twin: workers kept across epochs
    twin = tmp_path / "kept.py"
    twin.write_text((DATA / "epoch_restarts.py").read_text().replace("num_workers=2)", "num_workers=2, persistent_workers=True)"))
    b = audit("run", str(twin), "--steps", "40", out=tmp_path / "twin", env=ONE)
    assert b.returncode == 0, b.stderr[-3000:]
    assert b.rule("worker-restarts") == []
    kept = next(p for p in b.findings_doc["run_time"]["parts"] if p["name"] == "between")
    assert kept["ms"] < 0.5 * between["ms"]


@pytest.mark.slow
def test_evaluation_and_checkpoints_between_steps_are_a_finding(tmp_path) -> None:
    a = audit("run", str(DATA / "eval_and_save.py"), "--steps", "32", "--", "--ckpt-dir", str(tmp_path),
              out=tmp_path / "out", env=ONE)
    assert a.returncode == 0, a.stderr[-3000:]
    account = a.findings_doc["run_time"]
    _adds_up(account)
    between = next(p for p in account["parts"] if p["name"] == "between")
    what = {w["name"]: w for w in between["what"]}
    assert what["evaluation"]["ms"] > what["checkpoints"]["ms"] > 0 and what["epoch starts"]["ms"] == 0
    (f,) = a.rule("work-between-steps")
    assert f["evidence"]["after_steps"] == [3, 7, 11, 15, 19, 23, 27]
    assert f["cost"]["ms_per_step"] == pytest.approx(between["per_step_ms"], abs=2e-3)
    source = (DATA / "eval_and_save.py").read_text().splitlines()
    forward = next(n for n, text in enumerate(source, 1) if "expect: work-between-steps" in text)
    assert forward in {loc["line"] for loc in f["locations"]}
    assert f"module forwards x16 at eval_and_save.py line {forward} (" in f["message"]
    assert "evaluation: evaluate less often" in f["fix"]["summary"]


@pytest.mark.slow
def test_a_short_run_times_steps_and_says_it_has_too_few(tmp_path) -> None:
    """--steps 10: the steps right after the profiler window carry no checks (5-7), and the summary
    says in one line that 3 are too few, and what --steps gives enough."""
    a = audit("run", str(DATA / "epoch_restarts.py"), "--steps", "10", out=tmp_path / "out", env=ONE)
    assert a.returncode == 0, a.stderr[-3000:]
    steps = a.evidence["steps"]
    timed = [s["index"] for s in steps if not s["profiled"] and s.get("numerics") is None]
    assert timed == [5, 6, 7]
    assert a.findings_doc["run_time"]["timed_steps"] == 3 and a.findings_doc["run_time"]["ask_steps"] == 30
    (line,) = [ln for ln in a.stdout.splitlines() if ln.startswith("only 3 timed step(s)")]
    assert line.endswith(f"--steps {ASK_STEPS} times {ASK_GIVES}") and len(line) <= 120
    own = a.findings_doc["steps"]["own_cost"]
    assert own["timed_ms"] is not None and own["checked_ms"] is not None  # (the checks' cost is measured)


def test_the_timed_plan_of_short_runs() -> None:
    """What a run of N steps times (numerics.schedule.timed_block), with the profiler's window it has."""
    def plan(n: int) -> list[int]:
        warm, active = profile_plan(n)
        return sorted(timed_block(n, {*([warm] if warm is not None else []), *active}))

    assert plan(8) == [] and plan(10) == [5, 6, 7] and plan(18) == list(range(7, 14))
    assert plan(SHORT_RUN) == []  # (a run of 30 or more cuts its dense start instead)
    assert timed_block(10, set()) == frozenset()  # (--no-profile: checked whole)
    assert ASK_STEPS == SHORT_RUN and ASK_GIVES == TIMED_AT_LEAST


# ------------------------------------------------------------------------------------------------
# recordings derived from real GPU ones (tests/data/run_time/README.md)

def _raw(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def test_a_step_that_waits_for_its_device_is_device_bound() -> None:
    """The H200 step that issues its work in 12 ms and waits 238 ms for it in cudaDeviceSynchronize:
    the device is busy ~250 ms of its 250 ms host span (its work from the step's start, not from
    the GPU-side ProfilerStep range, 58 ms later). Device-bound: a faster kernel is a saving, a
    host-side fix is not."""
    path = DATA / "h200_gpu_bound_one_synced_step.json.gz"
    events = _raw(path)
    (step,) = [e for e in events if e.get("name", "").startswith("ProfilerStep#") and e.get("cat") == "user_annotation"]
    lo, hi = step["ts"], step["ts"] + step["dur"]
    busy = _union([(max(e["ts"], lo), min(e["ts"] + e["dur"], hi)) for e in events
                   if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e["ts"] < hi and e["ts"] + e["dur"] > lo])
    (gpu_step,) = [e for e in events if e.get("name", "").startswith("ProfilerStep#") and e.get("cat") == "gpu_user_annotation"]
    assert gpu_step["ts"] - lo > 50_000  # (the GPU-side range begins 58 ms into the step)
    ev = load_paths([path])
    clock = step_clock(ev, ev.trace_data[0])
    assert clock.bound == "device"
    assert clock.device_ms == pytest.approx(busy / 1000, abs=0.01) and busy / (hi - lo) > 0.95
    assert clock.host_ms == pytest.approx((hi - lo) / 1000, abs=1e-3)
    results = run_rules(ev)
    amp = next(f for f in results.findings if f.rule == "amp-opportunity")
    assert amp.cost.ms_per_step > 0.5 * clock.device_ms  # (device-side: counted on a device-bound step)
    sync = next(f for f in results.findings if f.rule == "host-sync")
    assert sync.cost.ms_per_step == 0.0  # (its wait is the device's work: removing it saves nothing)
    lines = [line.plain for line in summary_lines(ev, results, None)]
    assert any(line.startswith("step clock: device-bound: the device worked 249.") for line in lines), lines
    account = run_time(ev)
    assert account.floor_ms == pytest.approx(clock.device_ms, abs=0.01)
    assert account.part("syncs").ms == pytest.approx(238.16, abs=0.01)


def test_a_recording_with_stalls_and_no_profilersteps() -> None:
    """The V100 ResNet-50 recording whose loader stalls in one step in four (the num_workers=0 run's
    steps among the four-worker run's), with no ProfilerStep ranges: its 13 steps are found from its
    loop, the run's time holds the stalls (the median step does not), the slowest steps are the
    stalled ones, and the data wait, judged as a share of the run's time, is in the headline."""
    path = DATA / "v100_resnet50_stalls_no_schedule.pt.trace.json.gz"
    events = _raw(path)
    assert not any(str(e.get("name", "")).startswith("ProfilerStep#") for e in events)
    loads = [e for e in events if str(e.get("name", "")).startswith("enumerate(DataLoader)#")]
    stalls = sorted(e["dur"] / 1000 for e in loads if "_SingleProcessDataLoaderIter" in e["name"])
    assert len(stalls) == 3
    ev = load_paths([path])
    account = run_time(ev)
    trace = ev.trace_data[0]
    assert account.steps == len(trace.steps) == 13 and trace.steps_from
    ends = [float(x) for x in trace.steps["end"]]
    starts = [float(x) for x in trace.steps["ts"]]
    in_steps = sum(max(0.0, min(e["ts"] + e["dur"], ends[-1]) - max(e["ts"], starts[0])) for e in loads) / 1000
    assert account.part("data").ms == pytest.approx(in_steps, abs=0.01)
    assert account.base_ms > account.median_ms  # (the stalled steps lift the run's time, not its median)
    assert sorted(s.waited["data"] for s in account.slowest) == pytest.approx(stalls, abs=0.01)
    # 13% of the run's time: below dataloader-bound's default share (0.25); asked from 0.1, it warns,
    # costs the waits per step and the headline counts them
    assert not [f for f in run_rules(ev).findings if f.rule == "dataloader-bound"]
    config = Config(rule_options={"dataloader-bound": {"trace-min-share": 0.1}})
    results = run_rules(ev, config)
    (f,) = [f for f in results.findings if f.rule == "dataloader-bound"]
    assert f.cost.ms_per_step == pytest.approx(account.part("data").per_step_ms, abs=2e-3)
    assert "3 of 13 steps stalled" in f.message
    rec = recoverable(ev, results)
    assert rec.ms is not None and rec.ms >= f.evidence["stall_ms_per_step"] - 1e-3
    assert rec.ms <= account.base_ms - account.floor_ms + 1e-3
