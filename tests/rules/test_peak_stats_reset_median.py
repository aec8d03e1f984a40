"""peak-stats-reset on a CUDA run sets the median time of the resets against the median step: the
probes' record of a run whose `reset_peak_memory_stats()` blocks 30 ms in 3 of 15 steps and 1 ms in
the rest."""
from __future__ import annotations

from auditor.config import Config
from auditor.evidence import model as m
from auditor.evidence.frame import Frame
from auditor.rules.engine import run_rules

WHERE = Frame(file="/tmp/train.py", line=30, function="step", code="torch.cuda.reset_peak_memory_stats()")


def _run() -> m.Evidence:
    steps = [m.StepRecord(index=i, start_s=i * 0.05, ms=50.0, cpu_ms=48.0, tallies=[
        m.Tally(kind=m.STAT_RESET, what="torch.cuda.reset_peak_memory_stats", where=WHERE, count=1,
                ms=30.0 if i % 5 == 4 else 1.0)]) for i in range(15)]
    return m.Evidence(environment=m.Environment(device="cuda", cuda_available=True), steps=steps)


def test_a_reset_that_spikes_in_few_steps_is_costed_by_its_median():
    results = run_rules(_run(), Config(select={"peak-stats-reset"}))
    (f,) = [f for f in results.findings if f.rule == "peak-stats-reset"]
    # the mean (6.8 ms) that 3 slow steps lift is not the cost: the median step's 1.0 ms is
    assert f.cost.ms_per_step == 1.0 and f.cost.share_of_step == 0.02 and f.cost.measured
    assert "the median of the steps that made the calls" in f.cost.note


def test_the_resets_are_read_over_the_steps_the_median_step_is_of():
    """Steps 0-15 checked (their resets 30 ms: the checks' work queued before them), 16-29 timed
    (1 ms): the cost is the timed steps' median, as the median step is of the timed steps."""
    steps = [m.StepRecord(index=i, start_s=i * 0.05, ms=50.0, cpu_ms=48.0,
                          numerics=m.NumericsStep(ops=10) if i < 16 else None, tallies=[
        m.Tally(kind=m.STAT_RESET, what="torch.cuda.reset_peak_memory_stats", where=WHERE, count=1,
                ms=30.0 if i < 16 else 1.0)]) for i in range(30)]
    ev = m.Evidence(environment=m.Environment(device="cuda", cuda_available=True), steps=steps)
    assert ev.shown_median_ms() == 50.0 and len(ev.timed_steps()) == 14
    results = run_rules(ev, Config(select={"peak-stats-reset"}))
    (f,) = [f for f in results.findings if f.rule == "peak-stats-reset"]
    # over all 30 steps the median reset would be 30 ms (16 of them checked)
    assert f.cost.ms_per_step == 1.0 and f.cost.share_of_step == 0.02
