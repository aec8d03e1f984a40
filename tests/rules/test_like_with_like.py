"""Costs set against the run's time they are part of, and never above it: a cost above its step is
capped, and a real run whose data waits are long in the checked steps and short in the timed ones
is costed by the timed ones. (Stalls in some steps: tests/evidence/test_run_time.py.)"""
from __future__ import annotations

from statistics import fmean, median

import msgspec
import pytest

from conftest import FIXTURES, audit

from auditor.evidence.load import load_paths
from auditor.findings import Cost, Finding
from auditor.rules.engine import _capped

W0 = FIXTURES / "traces" / "v100_resnet50_dataloader_workers0.pt.trace.json.gz"


def test_a_cost_above_its_step_is_capped_and_says_so():
    ev = load_paths([W0])
    f = Finding(rule="x", severity="warning", title="t", message="m", evidence={"median_step_ms": 175.8},
                cost=Cost(ms_per_step=216.1, share_of_step=1.23, note="loader time"))
    # the median step it names (175.8 ms) is above the run's time per step (174.9 ms): capped at that
    c = _capped(f, ev).cost
    assert c.ms_per_step == 174.886 and c.share_of_step == 1.0
    assert c.note == "capped at the run's time per step (174.9 ms): the 216.1 ms/step measured exceeds it; loader time"
    named = msgspec.structs.replace(f, evidence={"median_step_ms": 150.0})
    c = _capped(named, ev).cost
    assert c.ms_per_step == 150.0 and c.share_of_step == pytest.approx(150.0 / 174.886, abs=1e-4)
    assert c.note == "capped at the step it is part of (150.0 ms): the 216.1 ms/step measured exceeds it; loader time"
    small = msgspec.structs.replace(f, cost=Cost(ms_per_step=10.0, share_of_step=0.06))
    assert _capped(small, ev) is small


# A dataset that decodes each sample on first use and serves it from memory after: its first epoch
# (18 steps) waits ~60 ms a batch, the later ones ~12 ms. In a 30-step audit the early steps are
# the checked ones and most timed steps come after the first epoch.
WARM_CACHE = """import time

import torch
from torch.utils.data import DataLoader, Dataset


class Decoded(Dataset):
    def __init__(self, n):
        self.n, self.cache = n, {}

    def __len__(self):
        return self.n

    def __getitem__(self, k):
        if k not in self.cache:
            time.sleep(0.06)  # decoding: the first epoch only
            self.cache[k] = torch.randn(16)
        time.sleep(0.012)  # augmentation: every epoch
        return self.cache[k]


loader = DataLoader(Decoded(18), batch_size=1)
model = torch.nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
it = iter(loader)


def step(i):
    global it
    try:
        x = next(it)
    except StopIteration:
        it = iter(loader)
        x = next(it)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    time.sleep(0.008)
"""


@pytest.mark.slow
def test_the_data_wait_is_read_over_the_steps_the_median_step_is_of(tmp_path):
    trainer = tmp_path / "warm_cache.py"
    trainer.write_text(WARM_CACHE)
    a = audit("run", f"{trainer}:step", "--steps", "30", "--select", "dataloader-bound", "--quiet",
              out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    steps = a.evidence["steps"]
    wait = {s["index"]: sum(t["ms"] for t in s["tallies"] if t["kind"] in ("data-wait", "data-iter")) for s in steps}
    timed = [s["index"] for s in steps if not s["profiled"] and s.get("numerics") is None]
    unprofiled = [s["index"] for s in steps if not s["profiled"]]
    median_ms = a.findings_doc["steps"]["median_ms"]
    base = a.findings_doc["run_time"]["base_ms"]
    # the case: waits outside the timed steps (the checked ones, in the first epoch) are long enough
    # that their median over every unprofiled step is several times the median (timed) step
    assert len(timed) >= 15 and len(unprofiled) > len(timed)
    assert median(wait[i] for i in unprofiled) > 2 * median_ms
    (f,) = a.rule("dataloader-bound")
    want = fmean(wait[i] for i in timed)  # (the timed steps' waits per step, not the checked ones')
    assert f["cost"]["ms_per_step"] == pytest.approx(want, abs=2e-3)
    assert f["cost"]["share_of_step"] == pytest.approx(want / base, abs=1e-3) and f["cost"]["share_of_step"] < 1
    assert "capped" not in f["cost"]["note"]
    assert f"The steps wait {want:.1f} ms a step for data ({f['cost']['share_of_step']:.0%} of the run's time)" in f["message"]
    assert f"{len(timed)} of {len(timed)} steps waited" in f["message"]
