"""A trace recorded without a profiler schedule (`with profile(): ...; prof.export_chrome_trace()`,
the way most tutorials record) has no ProfilerStep ranges. It was judged as one step: the headline
read '0 step(s), up to 90.78 ms/step recoverable', a finding '41%-41% across 1 steps', and the first
iteration (the profiler's start, every first call: 100 ms beside 5 ms steps) outweighed the rest.
Its steps are now the spans between the ends of torch.optim's `Optimizer.step#...` ranges. The
traces are recorded with torch.profiler by tests/data/recorded_trainer.py; expected numbers come
from the raw JSON.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import Recording, audit

@pytest.fixture
def recorded(recording: Recording) -> Path:
    """The folder the trainer ran in: eight.json and two.json, 8 and 2 DataLoader-bound iterations of
    one SGD step each, recorded without a schedule."""
    return recording.root


def raw(trace: Path) -> list[dict]:
    return [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X" and e.get("cat") != "Trace"]


def raw_optimizer_ends(events: list[dict]) -> list[float]:
    return sorted(e["ts"] + e["dur"] for e in events if e["name"] == "Optimizer.step#SGD.step")


def raw_loader_us(events: list[dict], lo: float, hi: float) -> float:
    return sum(max(0.0, min(e["ts"] + e["dur"], hi) - max(e["ts"], lo)) for e in events
               if e["name"].startswith("enumerate(DataLoader)") and e["name"].endswith("__next__"))


def test_steps_are_the_spans_between_optimizer_steps(recorded: Path) -> None:
    trace = recorded / "eight.json"
    events = raw(trace)
    assert not any(e["name"].startswith("ProfilerStep#") for e in events)
    ends = raw_optimizer_ends(events)
    assert len(ends) == 8
    a = audit("analyze", str(trace), out=recorded / "out-eight", cwd=recorded)
    assert a.returncode == 0, a.stderr
    steps = a.findings_doc["steps"]
    assert steps["count"] == 7
    assert steps["per_step_ms"] == pytest.approx([(b - a_) / 1000 for a_, b in zip(ends, ends[1:])], abs=2e-3)
    head = re.match(rf"audit of {re.escape(str(trace))}: 7 step\(s\), ([0-9.]+) ms/step over the run, "
                    r"median ([0-9.]+) ms/step", (a.out / "summary.txt").read_text())
    assert head, (a.out / "summary.txt").read_text()  # (findings.json keeps 3 decimals, the line 2: 7.235 may print as 7.23)
    assert float(head[1]) == pytest.approx((ends[-1] - ends[0]) / 1000 / 7, abs=0.0051)  # (their span over them)
    assert float(head[2]) == pytest.approx(steps["median_ms"], abs=0.0051)
    assert (f"{trace.name} has no ProfilerStep ranges (recorded without a schedule): its 7 steps are taken from the "
            f"end of one Optimizer.step#SGD.step to the end of the next") in a.findings_doc["environment"]["notes"][0]
    [f] = a.rule("dataloader-bound")  # each batch sleeps 6 ms: most of every step
    want = [raw_loader_us(events, lo, hi) / (hi - lo) for lo, hi in zip(ends, ends[1:])]
    assert [s["share"] for s in f["evidence"]["steps"]] == pytest.approx(want, abs=1e-3)
    # (the recording's own sanity, not the auditor's: a step slowed by another process's load
    # once had 43%, so the median step, not every step)
    # (a step another process's load held up reads as a stall: the message names those instead)
    assert sorted(want)[len(want) // 2] > 0.5 and ("across 7 steps" in f["message"] or " of 7 steps stalled " in f["message"])
    # the steps' loader time per step, over the run's time per step (their span over them)
    per_step = [raw_loader_us(events, lo, hi) for lo, hi in zip(ends, ends[1:])]
    assert f["cost"]["ms_per_step"] == pytest.approx(sum(per_step) / 7 / 1000, abs=2e-3)


def test_fewer_than_three_optimizer_steps_keep_the_whole_recording(recorded: Path) -> None:
    """The clean case: two optimizer steps make one span at most, not worth a step of its own; the
    whole recording is judged, and nothing is said about steps taken from the optimizer."""
    trace = recorded / "two.json"
    assert len(raw_optimizer_ends(raw(trace))) == 2
    a = audit("analyze", str(trace), out=recorded / "out-two", cwd=recorded)
    assert a.returncode == 0, a.stderr
    assert a.findings_doc["steps"]["count"] == 0 and a.findings_doc["environment"]["notes"] == []


# ------------------------------------------------------------------------------------------------
# Loops that step several optimizers an iteration, or one every few iterations. Each optimizer step
# was a step: a GAN's two Adams (both `Optimizer.step#Adam.step`) made two steps an iteration
# (per-step times halved), and accumulation's iterations without a step had no end of their own.

@pytest.fixture
def loops(recording: Recording) -> Path:
    """The folder the trainer ran in: gan_loader.json and gan.json (two Adams an iteration, with and
    without a DataLoader), accumulate.json (an SGD step every 2nd of 12 batches), logs.json (one SGD,
    more work every other of 10 iterations)."""
    return recording.root


def raw_ranges(events: list[dict], prefix: str) -> list[tuple[float, float]]:
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith(prefix))


def test_a_gan_iteration_of_two_adams_is_one_step(loops: Path) -> None:
    """Eight iterations, each stepping the discriminator's Adam then the generator's: 7 steps (the
    first iteration left out), each from one generator step's end to the next, each holding one
    batch and both optimizer steps. It read 15 steps of half an iteration."""
    trace = loops / "gan_loader.json"
    events = raw(trace)
    opt = raw_ranges(events, "Optimizer.step#Adam.step")
    fetches = raw_ranges(events, "enumerate(DataLoader)")
    assert len(opt) == 16 and len(fetches) == 8
    ends = [e for _, e in opt][1::2]  # each iteration's last optimizer step: the generator's
    a = audit("analyze", str(trace), out=loops / "out-gan-loader", cwd=loops)
    assert a.returncode == 0, a.stderr
    steps = a.findings_doc["steps"]
    assert steps["count"] == 7
    assert steps["per_step_ms"] == pytest.approx([(b - a_) / 1000 for a_, b in zip(ends, ends[1:])], abs=2e-3)
    for lo, hi in zip(ends, ends[1:]):
        assert sum(lo <= s < hi for s, _ in opt) == 2 and sum(lo <= s < hi for s, _ in fetches) == 1
    assert ("gan_loader.json has no ProfilerStep ranges (recorded without a schedule): its 7 steps are the loop's "
            "iterations, told apart by its DataLoader fetches, each from the end of one iteration's last "
            "Optimizer.step#Adam.step to the end of the next: 2 optimizer steps an iteration; what came before "
            "the first is left out") in a.findings_doc["environment"]["notes"]


def test_a_gan_without_a_dataloader_is_told_by_its_pattern(loops: Path) -> None:
    """No fetches to count: the two Adams run the same operators (same parameter count), but the
    discriminator's step follows a backward pass through D alone and the generator's one through D
    and G: the pattern repeats every 2 optimizer steps."""
    from auditor.evidence.trace.load import load_trace

    trace = load_trace(loops / "gan.json")
    ends = [e for _, e in raw_ranges(raw(loops / "gan.json"), "Optimizer.step#Adam.step")][1::2]
    assert len(ends) == 8
    assert trace.steps["end"].tolist() == pytest.approx(ends[1:], abs=1e-3)
    assert trace.steps["ts"].tolist() == pytest.approx(ends[:-1], abs=1e-3)
    assert trace.steps_from == ("are taken from the end of one run of 2 Optimizer.step#Adam.step to the end of the "
                                "next: the pattern their optimizers and backward passes repeat, taken as one iteration")


def test_gradient_accumulation_keeps_one_step_per_iteration(loops: Path) -> None:
    """Twelve batches, the optimizer stepped after every 2nd: 11 steps, one batch each. An
    iteration that steps no optimizer ends where the next batch is fetched (it was merged with the
    next iteration into one step of two batches)."""
    trace = loops / "accumulate.json"
    events = raw(trace)
    opt = [e for _, e in raw_ranges(events, "Optimizer.step#SGD.step")]
    fetch = [s for s, _ in raw_ranges(events, "enumerate(DataLoader)")]
    assert len(opt) == 6 and len(fetch) == 12
    ends = [opt[i // 2] if i % 2 else fetch[i + 1] for i in range(12)]  # iteration i's end
    a = audit("analyze", str(trace), out=loops / "out-accumulate", cwd=loops)
    assert a.returncode == 0, a.stderr
    steps = a.findings_doc["steps"]
    assert steps["count"] == 11
    assert steps["per_step_ms"] == pytest.approx([(b - a_) / 1000 for a_, b in zip(ends, ends[1:])], abs=2e-3)
    [note] = a.findings_doc["environment"]["notes"]
    assert note.endswith("0 to 1 optimizer steps an iteration; an iteration with none (gradient accumulation: 5 "
                         "of the 11) ends where the next fetch begins; what came before the first is left out")


def test_more_work_every_other_iteration_is_not_a_second_optimizer(loops: Path) -> None:
    """The clean case: one optimizer whose iterations alternate in length (a print with two .item()
    every other one): each optimizer step still ends a step, nothing is merged."""
    from auditor.evidence.trace.load import load_trace

    trace = load_trace(loops / "logs.json")
    ends = [e for _, e in raw_ranges(raw(loops / "logs.json"), "Optimizer.step#SGD.step")]
    assert len(ends) == 10
    assert trace.steps["end"].tolist() == pytest.approx(ends[1:], abs=1e-3)
    assert trace.steps_from == "are taken from the end of one Optimizer.step#SGD.step to the end of the next"
