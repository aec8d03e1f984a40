"""Costs set against the same statistic of the step they are part of, and never above it: a
recorded ResNet trace (num_workers=0) whose loader is made to spike every third step."""
from __future__ import annotations

import msgspec

from conftest import FIXTURES

import auditor.rules.dataloader_bound as dataloader_bound
from auditor.config import Config
from auditor.evidence.load import load_paths
from auditor.findings import Cost, Finding
from auditor.rules.engine import _capped
from auditor.reports.terminal import recoverable

W0 = FIXTURES / "traces" / "v100_resnet50_dataloader_workers0.pt.trace.json.gz"


def _spiky(real):
    """The trace's own per-step loader times, with every third step waiting 8x as long (its step
    time stays as recorded: the spike is what the mean over steps picks up)."""
    def shares(trace):
        out = real(trace)
        for k, s in enumerate(out):
            if k % 3 == 2:
                s["loader_ms"] = round(s["loader_ms"] * 8, 3)
        return out
    return shares


def test_a_spiking_loader_is_costed_by_its_median_against_the_median_step(monkeypatch):
    monkeypatch.setattr(dataloader_bound, "step_loader_shares", _spiky(dataloader_bound.step_loader_shares))
    from auditor.rules.engine import run_rules

    ev = load_paths([W0])
    results = run_rules(ev, Config(select={"dataloader-bound"}))
    f = next(f for f in results.findings if f.rule == "dataloader-bound")
    steps = f.evidence["steps"]
    loader = sorted(s["loader_ms"] for s in steps)
    want = (loader[len(loader) // 2 - 1] + loader[len(loader) // 2]) / 2  # 6 steps
    assert f.cost.ms_per_step == round(want, 3) == f.evidence["median_loader_ms"]
    # the mean the spikes raise (above the median step: 2 of 6 steps at 8x) is stated, not costed
    assert f.evidence["loader_ms_per_step"] > f.evidence["median_step_ms"] > f.cost.ms_per_step
    assert f"mean {f.evidence['loader_ms_per_step']:.1f} ms" in f.message
    assert f.cost.share_of_step < 1.0
    rec = recoverable(ev, results)
    assert rec.ms is not None and rec.ms <= ev.shown_median_ms()


def test_a_cost_above_its_step_is_capped_and_says_so():
    ev = load_paths([W0])
    f = Finding(rule="x", severity="warning", title="t", message="m", evidence={"median_step_ms": 175.8},
                cost=Cost(ms_per_step=216.1, share_of_step=1.23, note="loader time"))
    c = _capped(f, ev).cost
    assert c.ms_per_step == 175.8 and c.share_of_step <= 1.0
    assert c.note == "capped at the median step (175.8 ms): the 216.1 ms/step measured exceeds it; loader time"
    small = msgspec.structs.replace(f, cost=Cost(ms_per_step=10.0, share_of_step=0.06))
    assert _capped(small, ev) is small
