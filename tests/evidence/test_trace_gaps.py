"""The GPU gap attribution (auditor.evidence.trace.gaps): on every recorded fixture, each cause's
idle per step equals an independent stdlib reading of the raw JSON (tests/raw_gaps.py); on small
made-up traces, each rule of the attribution on its own."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from auditor.evidence.trace.gaps import CAUSES, QUEUED_KINDS, GapSummary, gap_table, summarize, sync_charges
from auditor.evidence.trace.load import load_trace
from auditor.evidence.trace.names import is_comm_kernel
from conftest import FIXTURES
from raw_gaps import per_step, raw_gaps

TRACES = FIXTURES / "traces"
ALL = sorted(p.name for p in TRACES.glob("*.pt.trace.json.gz")) if TRACES.is_dir() else []


@pytest.mark.parametrize("name", ALL)
def test_causes_match_the_raw_reading(name: str) -> None:
    trace = load_trace(TRACES / name)
    summary = summarize(trace, gap_table(trace))
    raw = per_step(str(TRACES / name))
    assert {c.cause: c.ms_per_step for c in summary.causes} == pytest.approx(raw, abs=1e-3)
    # every idle moment of the window has one cause
    assert summary.idle_ms / summary.steps == pytest.approx(sum(raw.values()), abs=1e-3)
    assert summary.recoverable_ms_per_step == pytest.approx(
        sum(raw[c] for c in ("host synchronisation", "data loading", "host work", "launch")), abs=1e-3)
    assert msgspec.json.decode(msgspec.json.encode(summary), type=GapSummary) == summary  # a typed record


def test_rank0_idle_waits_on_queued_graph_work() -> None:
    """A100 TorchRec rank 0: 135.3 of the 138.6 ms of idle per step had the next GPU work already
    queued, 103.5 ms of it launched as CUDA graphs; the five ~64 ms gaps under `## sparse_data_dist
    ##` began ~66 ms after the launch of the work that ended them (HTA 0.5's queue length on stream
    7 reads 508 to 750 at their starts)."""
    trace = load_trace(TRACES / "a100_rank0_cpu_item_cudagraphs.pt.trace.json.gz")
    table = gap_table(trace)
    summary = summarize(trace, table)
    assert summary.ms_per_step("queued work") == pytest.approx(135.345, abs=1e-3)
    assert summary.queued_by_ms_per_step["graph launch"] == pytest.approx(103.453, abs=1e-3)
    assert summary.recoverable_ms_per_step == pytest.approx(2.565, abs=1e-3)
    big = [i for i in range(len(table.start)) if table.end[i] - table.start[i] > 60_000]
    assert len(big) == 5 and all(table.us[i, CAUSES.index("queued work")] == table.end[i] - table.start[i] for i in big)
    ts = trace.col("ts")
    graph = [i for i in big if table.launch_row[i] >= 0]
    assert len(graph) == 4 and all(trace.name(int(table.launch_row[i])) == "cudaGraphLaunch" for i in graph)
    assert all(65_000 < table.start[i] - ts[int(table.launch_row[i])] < 67_000 for i in graph)
    # the first one's launch came before the profiler started: queued, since work after it on its
    # stream was launched before the gap
    (first,) = set(big) - set(graph)
    assert QUEUED_KINDS[int(table.queued_kind[first])] == "same stream"


def test_ddp_launch_starved_gaps() -> None:
    """DDP rank 0: gaps under 1 ms whose next op's launch began after the gap began (or was still
    running then): 848 a step, 117.21 ms per step, 107.41 of it host work before the launch and
    9.80 the launch calls themselves."""
    trace = load_trace(TRACES / "a100_ddp_nccl_2rank.pt.trace.json.gz")
    table = gap_table(trace)
    starved = table.of("host work") + table.of("launch")
    short = (table.end - table.start < 1000) & (starved > 0)
    assert int(short.sum()) == 2543  # 3 steps
    assert starved[short].sum() / 1000 / 3 == pytest.approx(117.206, abs=1e-3)
    assert table.of("launch")[short].sum() / 1000 / 3 == pytest.approx(9.798, abs=1e-3)


# ---------------------------------------------------------------------------------------------
def x(cat: str, name: str, ts: float, dur: float, tid: int = 1, pid: int = 1, **args: Any) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def kernel(name: str, ts: float, dur: float, corr: int, stream: int = 7) -> dict:
    return x("kernel", name, ts, dur, tid=stream, pid=0, correlation=corr, stream=stream)


def launch(ts: float, corr: int, name: str = "cudaLaunchKernel", dur: float = 5, tid: int = 1) -> dict:
    return x("cuda_runtime", name, ts, dur, tid=tid, correlation=corr)


def table_of(tmp_path: Path, events: list[dict]) -> tuple[Any, dict[str, float]]:
    events = [x("user_annotation", "ProfilerStep#1", 0, 10_000), *events]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    trace = load_trace(path)
    table = gap_table(trace)
    raw = {c: sum(g["us"][c] for g in raw_gaps(events)) for c in CAUSES}
    assert dict(zip(CAUSES, table.us.sum(axis=0).tolist())) == pytest.approx(raw, abs=1e-6)
    return trace, raw


def test_work_queued_before_the_gap_is_a_dependency(tmp_path: Path) -> None:
    """The second kernel was launched at 50 us, on another stream after an event wait: the GPU's
    400 us without work are the dependency's, not the host's."""
    trace, us = table_of(tmp_path, [
        launch(0, 1), kernel("a", 10, 90, 1),
        x("cuda_runtime", "cudaStreamWaitEvent", 40, 2),
        launch(50, 2), kernel("b", 500, 100, 2, stream=8),
        launch(9000, 3), kernel("c", 9010, 990, 3)])
    table = gap_table(trace)
    i = int((table.start == 100).nonzero()[0][0])
    assert table.us[i, CAUSES.index("queued work")] == 400 and QUEUED_KINDS[int(table.queued_kind[i])] == "event wait"
    assert us["queued work"] == 400


def test_a_sync_is_charged_from_its_start_until_the_next_launch(tmp_path: Path) -> None:
    """Kernel until 1,000; the host syncs 500-1,010, works until 3,000, launches: the sync is charged
    1,000-3,000 (the launch calls and their start latency, 10 us before each kernel, are `launch`)."""
    trace, us = table_of(tmp_path, [
        launch(0, 1), kernel("a", 10, 990, 1),
        x("cuda_runtime", "cudaStreamSynchronize", 500, 510),
        launch(3000, 2), kernel("b", 3010, 6990, 2)])
    assert us["host synchronisation"] == 2000 and us["launch"] == 20
    table = gap_table(trace)
    (charge,) = sync_charges(trace, table, [[int(r)] for r in trace.named("cudaStreamSynchronize").index])
    # removing it saves its wait (510 us), not the 2,000 us of host work that follow it
    assert (charge.blocked_us, charge.idle_us, charge.saving_us) == (510, 2000, 510)


def test_a_launch_after_the_sync_takes_the_charge_away(tmp_path: Path) -> None:
    """The host launched (another kernel, queued behind a dependency) after the sync returned: the
    idle before the next op is no longer the sync's."""
    _, us = table_of(tmp_path, [
        launch(0, 1), kernel("a", 10, 990, 1),
        x("cuda_runtime", "cudaStreamSynchronize", 500, 510),
        launch(1500, 2), kernel("b", 5000, 100, 2, stream=8),
        launch(3000, 3), kernel("c", 3010, 990, 3)])
    assert us["host synchronisation"] == 0 and us["host work"] == 2000


def test_data_loading_comes_before_the_sync(tmp_path: Path) -> None:
    _, us = table_of(tmp_path, [
        launch(0, 1), kernel("a", 10, 990, 1),
        x("cuda_runtime", "cudaStreamSynchronize", 500, 510),
        x("user_annotation", "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 1500, 1000),
        launch(3000, 2), kernel("b", 3010, 6990, 2)])
    assert us["data loading"] == 1000 and us["host synchronisation"] == 1000


def test_a_graph_launch_and_an_unrecorded_launch(tmp_path: Path) -> None:
    """Kernels of one graph launch share its correlation: the gap between them is queued work. A
    kernel whose launch is not in the trace is queued when work after it on its stream was launched
    before the gap began, untraced otherwise."""
    trace, us = table_of(tmp_path, [
        launch(0, 1, "cudaGraphLaunch", dur=20), kernel("g1", 30, 100, 1), kernel("g2", 300, 100, 1),
        kernel("lost", 1000, 100, 99), launch(200, 3), kernel("after", 1200, 100, 3),
        kernel("late_lost", 5000, 100, 98)])
    table = gap_table(trace)
    kinds = {int(table.start[i]): QUEUED_KINDS[int(k)] for i, k in enumerate(table.queued_kind) if k >= 0}
    assert kinds[130] == "graph launch" and kinds[400] == "same stream"  # (400-1000: `lost`, queued by `after`)
    assert us["untraced"] == (5000 - 1300) + (10_000 - 5100)


def test_nccl_kernels_are_communication() -> None:
    for name in ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)",
                 "ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
                 "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)"):
        assert is_comm_kernel(name)
    for name in ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float> >",
                 "ampere_sgemm_128x64_nn", "Memcpy DtoD (Device -> Device)"):
        assert not is_comm_kernel(name)
