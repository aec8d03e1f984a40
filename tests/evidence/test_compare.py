"""auditor.evidence.compare: per-step statistics, the noise a change is judged against, and the
pairing of findings (auditor.diff) on real recorded traces."""
from __future__ import annotations

import pytest

from auditor.evidence.compare import RESOLUTION, Stat, compare, delta, kernel_group, stat, summarize
from conftest import FIXTURES

WORKERS0 = FIXTURES / "traces" / "v100_resnet50_dataloader_workers0.pt.trace.json.gz"


def test_stat_is_the_median_and_half_the_interquartile_range():
    s = stat([10.0, 11.0, 12.0, 13.0, 50.0])
    assert (s.median, s.n) == (12.0, 5)
    assert s.spread == pytest.approx((13.0 - 11.0) / 2)  # the outlier moves neither
    assert stat([]) is None and stat([3.0]).spread == 0.0


def test_a_change_within_the_combined_spread_is_within_noise():
    a, b = Stat(100.0, 3.0, 10), Stat(104.0, 4.0, 10)
    d = delta("step", "median step", "ms", a, b)
    assert d.noise == pytest.approx(5.0) and d.verdict == "within noise" and d.pct == pytest.approx(4.0)
    assert delta("step", "x", "ms", a, Stat(106.0, 4.0, 10)).verdict == "worse"
    assert delta("step", "x", "ms", a, Stat(94.0, 4.0, 10)).verdict == "better"
    # steps that repeat exactly still have RESOLUTION of noise: 0.5% is no change
    assert delta("kernel", "k", "ms", Stat(10.0), Stat(10.05)).verdict == "within noise"
    assert delta("kernel", "k", "ms", Stat(10.0), Stat(10.0 * (1 + 2 * RESOLUTION))).verdict == "worse"
    assert delta("op", "k", "ms", None, Stat(1.0)).verdict == "new"
    assert delta("op", "k", "ms", Stat(1.0), None).verdict == "gone"


def test_kernel_group_drops_templates_and_parameters():
    assert kernel_group("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int)") \
        == "at::native::vectorized_elementwise_kernel"
    assert kernel_group("volta_sgemm_64x64_nt") == "volta_sgemm_64x64_nt"


def test_a_trace_compared_with_itself_changes_nothing():
    from auditor.evidence.load import load_paths

    ev = load_paths([WORKERS0])
    side = summarize(ev, "a")
    assert side.kind == "trace" and side.steps == 6
    assert side.step_ms.median == pytest.approx(ev.trace_data[0].median_step_ms())
    assert side.syncs.median == 2.0 and side.copies.median == 2.0  # host-sync: 2 per step; 2 H2D copies
    assert side.copy_bytes.median == pytest.approx(115.61e6 / 6, rel=1e-3)  # pageable-copy: 19.27 MB per step
    assert side.kernels and side.ops and {"data", "optimizer", "gpu busy"} <= set(side.phases)
    c = compare(side, summarize(ev, "b"))
    assert c.step_pct == 0.0
    assert {d.verdict for d in c.deltas} <= {"within noise", "same"}
    assert c.run_pct == 0.0 and c.judged_by == "run's time per step"


def test_the_runs_time_of_a_recording_and_its_noise():
    """A recording's run's time per step is its account's (auditor.evidence.run_time); its per-step
    values (each step on its bound's clock and the gap after it) add up to it, its parts' too, and
    its noise is their median absolute deviation: a step far off the others moves it little."""
    import statistics

    from auditor.evidence.load import load_paths
    from auditor.evidence.run_time import per_step, run_time

    ev = load_paths([WORKERS0])
    account, values = run_time(ev), per_step(ev)
    side = summarize(ev, "a")
    assert side.run_ms.value == account.base_ms and side.run_steps == account.steps == len(values["run"]) == 6
    assert sum(values["run"]) / 6 == pytest.approx(account.base_ms, abs=1e-3)
    for name in ("work", "data", "between", "syncs"):
        assert sum(values[name]) / 6 == pytest.approx(account.part(name).per_step_ms, abs=1e-3), name
        assert side.run_parts[name].value == account.part(name).per_step_ms
    mid = statistics.median(values["run"])
    assert side.run_ms.noise == pytest.approx(statistics.median(abs(v - mid) for v in values["run"]))
    assert side.run_ms.noise < statistics.pstdev(values["run"])
