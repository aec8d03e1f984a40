"""peak-stats-reset does not synchronise the device, so the GPU's idle behind the step's syncs is
not its to claim. The H100 recording of examples/demo.py (tests/fixtures/h100/plain/plain_demo.json.gz:
steps 6-8, no auditor in the process) shows it: `_cuda_resetPeakMemoryStats` runs 1.4-1.6 us at the
step's start with no CUDA call under it, and every `cudaStreamSynchronize` of the step is under
`aten::to` or `aten::item`. Here that trace is the profiled window of a run whose probes saw the
demo's calls (the reset at its H100-measured 0.031 ms; the syncs of its `.to()` and `.item()`)."""
from __future__ import annotations

import gzip
import json

from conftest import FIXTURES

from auditor.config import Config
from auditor.evidence import model as m
from auditor.evidence.frame import Frame
from auditor.evidence.load import load_paths
from auditor.rules.engine import run_rules

DEMO = FIXTURES / "h100" / "plain" / "plain_demo.json.gz"
FILE = "/src/examples/demo.py"


def _at(line: int, code: str) -> Frame:
    return Frame(file=FILE, line=line, function="step", code=code)


RESET = _at(39, "torch.cuda.reset_peak_memory_stats()")
TO = _at(45, "x, y = x.to(device), y.to(device)")
ITEM = _at(51, 'log.append({"step": i, "loss": loss.item(), "peak": torch.cuda.max_memory_allocated()})')


def _run() -> m.Evidence:
    ev = load_paths([DEMO])
    ev.source = "run"
    ev.environment.device, ev.environment.cuda_available = "cuda", True
    ev.steps = [m.StepRecord(index=i, start_s=i * 0.04, ms=37.0, cpu_ms=36.0, tallies=[
        m.Tally(kind=m.STAT_RESET, what="torch.cuda.reset_peak_memory_stats", where=RESET, count=1, ms=0.031),
        m.Tally(kind=m.SYNC, what="Tensor.to", where=TO, count=2, ms=0.04, data={"device": "cuda"}),
        m.Tally(kind=m.SYNC, what="Tensor.item", where=ITEM, count=1, ms=0.015, data={"device": "cuda"}),
    ]) for i in range(15)]
    return ev


def test_the_recorded_reset_makes_no_device_call():
    events = [e for e in json.loads(gzip.open(DEMO, "rt").read())["traceEvents"] if e.get("ph") == "X"]
    resets = [e for e in events if e.get("name") == "<built-in function _cuda_resetPeakMemoryStats>"]
    assert len(resets) == 3 and all(e["dur"] < 2.0 for e in resets)
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    assert not [e for r in resets for e in runtime if r["ts"] <= e["ts"] <= r["ts"] + r["dur"]]


def test_the_syncs_idle_is_host_syncs_not_the_resets():
    results = run_rules(_run(), Config(select={"peak-stats-reset", "host-sync", "gpu-idle"}))
    by_rule = {f.rule: f for f in results.findings}
    reset, sync, idle = by_rule["peak-stats-reset"], by_rule["host-sync"], by_rule["gpu-idle"]
    # the reset's cost is its calls' own time: nothing of the idle behind the step's syncs
    assert reset.cost.ms_per_step == 0.031 and "behind its syncs" not in reset.message
    assert "idle_ms_per_step" not in reset.evidence
    assert "does not synchronise the device" in reset.message
    # the syncs' idle (1.25 ms a step in this trace) is host-sync's, whole
    synced = idle.evidence["idle_by_cause_ms_per_step"]["host synchronisation"]
    assert synced > 1.0 and sync.cost.ms_per_step == round(synced, 3)
    # (the reset's own host time is some of the host work the GPU idles through, and no more)
    explained = idle.evidence["explained_by_ms_per_step"]
    assert explained["host-sync"] == round(synced, 3) and explained.get("peak-stats-reset", 0.0) <= 0.031
