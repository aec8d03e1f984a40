"""On a host-bound recording, a fix that only makes the device's work faster shortens the step only
where the host waits for that work: inside its syncs (auditor.evidence.step_clock.waited_ms,
auditor.findings.saving_on_path). The OWLv2 step on an H100 is host-bound (1211 ms on the host
against 567 ms of kernels): unfused-attention measured 465.8 ms of attention kernels, but the host
waits for the device only 366 ms a step, so its fix saves at most that, and its message says why.
Expected figures from the raw JSON (gzip + json)."""
from __future__ import annotations

import pytest

from auditor.evidence.step_clock import step_clock
from test_recoverable import analysed
from test_trace_rules import GPU_CATS, OWL, RAW_SYNCS, W0, _merge, _overlap, raw, raw_steps


def raw_blocking(events: list[dict]) -> list[dict]:
    """The runtime calls in which the host waits for the GPU, in either schema (`cuda_runtime`, the
    V100's `Runtime`): the syncs, and the cudaMemcpyAsync calls whose copy (same correlation) is
    device-to-pageable."""
    to_pageable = {e["args"]["correlation"] for e in events if e.get("cat") in ("gpu_memcpy", "Memcpy")
                   and "DtoH" in e.get("name", "") and "Pageable" in e.get("name", "")}
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "Runtime")
            and (e.get("name") in RAW_SYNCS
                 or (e.get("name") == "cudaMemcpyAsync" and e.get("args", {}).get("correlation") in to_pageable))]


def raw_waited_ms(name: str) -> float:
    """The GPU's busy time inside the host's blocking calls (syncs, copies to pageable memory),
    within the ProfilerSteps, per step."""
    steps = raw_steps(name)
    lo, hi = steps[0][0], steps[-1][1]
    waits = _merge([(max(e["ts"], lo), min(e["ts"] + e["dur"], hi)) for e in raw_blocking(raw(name))])
    busy = _merge([(e["ts"], e["ts"] + e["dur"]) for e in raw(name) if e.get("ph") == "X" and e.get("cat") in GPU_CATS])
    return _overlap(waits, busy) / 1000 / len(steps)


def test_a_device_side_fix_on_a_host_bound_recording_saves_only_the_hosts_waits() -> None:
    ev, results = analysed(OWL)
    clock = step_clock(ev, ev.trace_data[0])
    assert clock.bound == "host" and clock.host_ms > 2 * clock.device_ms
    waited = raw_waited_ms(OWL)
    assert clock.waited_ms == pytest.approx(waited, rel=0.01) and 300 < waited < 400
    f = next(f for f in results.findings if f.rule == "unfused-attention")
    measured = f.evidence["measured_ms_per_step"]
    assert measured > waited  # (the attention kernels' time the rule measured: 465.8 ms)
    assert f.cost.ms_per_step == pytest.approx(clock.waited_ms, abs=1e-3)
    assert f.evidence["bound"] == "host" and f.evidence["waited_ms_per_step"] == pytest.approx(waited, rel=0.01)
    assert (f"not the {measured:.2f} ms measured: the step is host-bound" in f.message
            and "shortens a host-bound step only where the host waits for the device" in f.message)


def test_a_host_bound_step_that_never_waits_for_its_kernels_gets_nothing_from_faster_ones() -> None:
    """The V100 ResNet (num_workers=0) waits for data, not for the device: amp-opportunity's 55.6 ms
    of fp32 kernels would take almost nothing off its step."""
    ev, results = analysed(W0)
    f = next(f for f in results.findings if f.rule == "amp-opportunity")
    waited = raw_waited_ms(W0)
    assert waited < 1.0 and f.evidence["measured_ms_per_step"] > 50
    assert f.cost.ms_per_step == pytest.approx(waited, abs=0.01)
    assert "only where the host waits for the device" in f.message
