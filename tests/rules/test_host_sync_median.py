"""host-sync on a CUDA run sets the median blocked time against the median step and states how firm
it is: the probes' record of a run whose `.item()` blocks 40 ms in 4 of 20 steps and 2 ms in the rest."""
from __future__ import annotations

from auditor.config import Config
from auditor.evidence import model as m
from auditor.evidence.frame import Frame
from auditor.rules.engine import run_rules

WHERE = Frame(file="/tmp/train.py", line=12, function="step", code="loss.item()")


def _run() -> m.Evidence:
    steps = [m.StepRecord(index=i, start_s=i * 0.05, ms=50.0, cpu_ms=48.0, tallies=[
        m.Tally(kind=m.SYNC, what="Tensor.item", where=WHERE, count=1, ms=40.0 if i % 5 == 4 else 2.0,
                data={"device": "cuda"})]) for i in range(20)]
    return m.Evidence(environment=m.Environment(device="cuda", cuda_available=True), steps=steps)


def test_a_sync_that_spikes_in_few_steps_is_costed_by_its_median():
    results = run_rules(_run(), Config(select={"host-sync"}))
    (f,) = [f for f in results.findings if f.rule == "host-sync"]
    # the mean (9.6 ms) that 4 slow steps lift is not the cost: the median step's 2.0 ms is
    assert f.cost.ms_per_step == 2.0 and f.cost.share_of_step == 0.04 and f.cost.measured
    assert "the median of the steps that made the calls" in f.cost.note
    assert f.evidence["confidence"] == "high" and f.evidence["cost_ms_quartiles"] == [2.0, 2.0, 2.0]
    assert f.evidence["steps_timed"] == 20 and f.evidence["cpu_over_wall"] == 0.96
    assert f.message.endswith("Confidence: high (the syncs took 2.00-2.00 ms in the middle half of the 20 steps "
                              "that made the calls, median 2.00 ms).")
