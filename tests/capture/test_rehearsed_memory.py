"""OOM forecast for rehearsed code: the requests a rehearsed program's GPU tensors make, replayed by the
simulated allocator into the snapshot its own `_dump_snapshot` call writes, and `audit analyze` of it."""
from __future__ import annotations

import json

import pytest

from auditor.evidence.allocator.analysis import analyze
from auditor.evidence.allocator.config import AllocatorConfig
from auditor.evidence.allocator.synth import snapshot_from_requests
from auditor.evidence.snapshot import MiB, load_snapshot

from conftest import audit

TRAINER = '''
import sys
import torch

torch.cuda.memory._record_memory_history(max_entries=100000)
x = torch.zeros(1024, 1024, device="cuda")      # 4 MiB: a 20 MiB segment, split
y = torch.zeros(3 * 1024 * 1024, device="cuda")  # 12 MiB: the rest of that segment
del x
z = torch.zeros(256, device="cuda")              # 1 KiB: a 2 MiB small-pool segment
torch.cuda.memory._dump_snapshot(sys.argv[1])
print(float(y.sum() + z.sum()))
'''


def _frames(line: int) -> list[dict]:
    return [{"filename": "/work/train.py", "line": line, "name": "step"}]


def test_requests_become_the_snapshot_a_gpu_would_write(tmp_path):
    reqs = [{"action": "alloc", "id": 1, "size": 4 * MiB, "time_us": 1, "frames": _frames(5)},
            {"action": "alloc", "id": 2, "size": 12 * MiB, "time_us": 2, "frames": _frames(6)},
            {"action": "free", "id": 1, "size": 0, "time_us": 3},
            {"action": "alloc", "id": 3, "size": 1024, "time_us": 4, "frames": _frames(8)}]
    raw = snapshot_from_requests(reqs, AllocatorConfig(), capacity=1 << 30)
    assert [e["action"] for e in raw["device_traces"][0]] == [
        "segment_alloc", "alloc", "alloc", "free_requested", "free_completed", "segment_alloc", "alloc"]
    assert sorted(s["total_size"] for s in raw["segments"]) == [2 * MiB, 20 * MiB]


@pytest.mark.slow
def test_a_rehearsed_trainer_forecasts_its_peak_and_its_oom(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAINER)
    snap_path = tmp_path / "snap.pickle"
    a = audit("run", str(script), "--to-end", "--no-profile", "--quiet", "--", str(snap_path), out=tmp_path / "run")
    assert a.returncode == 0, a.stderr
    snap = load_snapshot(snap_path)
    r = analyze(snap, 0)
    # the sizes it allocates: 4 + 12 MiB live at once; a 20 MiB and a 2 MiB segment
    assert r.recorded.allocated_peak_bytes == 16 * MiB and r.recorded.reserved_peak_bytes == 22 * MiB
    assert r.replayed == r.recorded
    owners = {(b.owner.line if b.owner else None) for s in snap.segments for b in s.blocks if b.live}
    assert owners == {7, 9}  # y and z, by the lines that made them
    # on a 15 MiB device the first request already fails: audit analyze names the line
    small = tmp_path / "small.pickle"
    a = audit("run", str(script), "--to-end", "--no-profile", "--quiet", "--device-memory", str(15 / 1024),
              "--", str(small), out=tmp_path / "run2")
    assert a.returncode == 0, a.stderr
    a = audit("analyze", str(small), out=tmp_path / "an")
    assert a.returncode == 0, a.stderr
    doc = json.loads((tmp_path / "an" / "findings.json").read_text())
    ooms = [f for f in doc["findings"] if f["rule"] == "oom-risk"]
    assert ooms and ooms[0]["locations"][0]["line"] == 6


ADAM = '''
import sys
import torch
from torch import nn

torch.cuda.memory._record_memory_history()
model = nn.Linear(1024, 1024).cuda()
opt = torch.optim.Adam(model.parameters())
x = torch.randn(256, 1024, device="cuda")
model(x).square().mean().backward()
opt.step()
torch.cuda.memory._dump_snapshot(sys.argv[1])
'''


@pytest.mark.slow
def test_gradients_and_optimizer_state_are_requests(tmp_path):
    """Gradients, made by autograd in C++, are taken when they land (line 10, the backward); Adam's
    two state tensors per parameter at its step (line 11)."""
    script = tmp_path / "adam.py"
    script.write_text(ADAM)
    a = audit("run", str(script), "--to-end", "--no-profile", "--quiet", "--", str(tmp_path / "s.pickle"),
              out=tmp_path / "run")
    assert a.returncode == 0, a.stderr
    snap = load_snapshot(tmp_path / "s.pickle")
    allocs = [(e.size, e.owner.line) for e in snap.device_traces[0] if e.action == "alloc" and e.owner]
    weight = 1024 * 1024 * 4
    assert (weight, 7) in allocs and (weight, 10) in allocs  # the weight, then its gradient
    assert sum(1 for s, line in allocs if s == weight and line == 11) >= 2  # exp_avg, exp_avg_sq
    # the optimizer step's end is annotated as the profiler does: the replay's reserve per step
    assert [a.name for a in snap.external_annotations] == ["Optimizer.step#Adam.step"]
    steps = analyze(snap, 0).per_step
    assert [p.step for p in steps] == [0] and steps[0].reserved_peak_bytes >= 4 * weight  # weight, grad, 2 states


PRE_HISTORY = '''
import sys
import torch

w = torch.zeros(16, device="cuda", requires_grad=True)
opt = torch.optim.SGD([w], lr=0.1)
(w * 2).sum().backward()
opt.step()


def build_and_step():                           # a model and optimizer that die before the history
    model = torch.nn.Linear(256, 256).to("cuda")  # a 256 KiB weight
    adam = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 256, device="cuda")).sum().backward()
    adam.step()                                 # the last training step: what follows is in the next one


build_and_step()
keep = torch.zeros(768 * 1024, device="cuda")   # 3 MiB, made before the history
tmp = torch.ones(256 * 1024, device="cuda")     # 1 MiB
twice = tmp * 2                                 # 1 MiB, kept
del tmp                                         # freed before the history: no block
torch.cuda.memory._record_memory_history()
y = torch.zeros(1024 * 1024, device="cuda")     # 4 MiB, in the trace
torch.cuda.memory._dump_snapshot(sys.argv[1])
'''


@pytest.fixture(scope="module")
def pre_history(tmp_path_factory):
    """One rehearsed run of PRE_HISTORY: its snapshot's live blocks (requested size, has a stack)
    and its trace."""
    tmp = tmp_path_factory.mktemp("pre_history")
    script = tmp / "pre.py"
    script.write_text(PRE_HISTORY)
    a = audit("run", str(script), "--to-end", "--no-profile", "--quiet", "--", str(tmp / "s.pickle"), out=tmp / "run")
    assert a.returncode == 0, a.stderr
    snap = load_snapshot(tmp / "s.pickle")
    live = sorted((b.requested_size, bool(b.frames)) for s in snap.segments for b in s.blocks if b.live)
    return snap, live


@pytest.mark.slow
def test_tensors_made_before_the_history_are_in_the_forecast(pre_history):
    """A program that builds its model before switching the history on (as the cs336 benchmark
    does) is forecast with it: its GPU tensors alive at that moment are live blocks of the
    snapshot, with no stack and no trace entry, as torch keeps allocations older than the history."""
    snap, live = pre_history
    assert (3 * MiB, False) in live and (1 * MiB, False) in live  # keep, twice
    assert [(e.action, e.size) for e in snap.device_traces[0]] == [("alloc", 4 * MiB)]  # y
    assert analyze(snap, 0).recorded.allocated_peak_bytes >= 8 * MiB  # keep + twice + y


@pytest.mark.slow
def test_the_numerics_checks_keep_no_rehearsed_tensor_alive_while_history_records(pre_history):
    """A tensor the program let go before recording (`tmp`) is not in the forecast: the numerics
    collector, which keeps CPU calls' tensors for a deferred check, keeps none while a rehearsed
    memory history records (they are device memory there), and lets go of what it kept."""
    snap, live = pre_history
    assert live == [(64, False), (64, False), (1 * MiB, False), (3 * MiB, False), (4 * MiB, True)]
    assert analyze(snap, 0).recorded.allocated_peak_bytes == 8 * MiB + 2 * 64  # w, its grad, twice, keep, y


@pytest.mark.slow
def test_a_dead_optimizers_parameters_are_not_in_the_forecast(pre_history):
    """The model and optimizer `build_and_step` made are gone when the history starts: none of
    their tensors (a 256 KiB weight, its gradient, AdamW's two states) is in the forecast. The
    numerics collector's record of that optimizer's step kept them alive until the step ended."""
    snap, live = pre_history
    assert 256 * 256 * 4 not in {size for size, _ in live}


TWO_HISTORIES = '''
import sys
import torch

torch.cuda.memory._record_memory_history()
a = torch.zeros(1024 * 1024, device="cuda")      # 4 MiB, in the first history
torch.cuda.memory._dump_snapshot(sys.argv[1])
torch.cuda.memory._record_memory_history(enabled=None)
b = torch.zeros(2 * 1024 * 1024, device="cuda")  # 8 MiB, while nothing records
torch.cuda.memory._record_memory_history()
c = torch.zeros(512 * 1024, device="cuda")       # 2 MiB, in the second history
torch.cuda.memory._dump_snapshot(sys.argv[2])
torch.cuda.memory._record_memory_history(enabled=None)
torch.cuda.memory._dump_snapshot(sys.argv[3])
'''


@pytest.mark.slow
@pytest.mark.parametrize("watched", [False, True], ids=["plain", "device-memory"])
def test_a_history_switched_off_is_dropped_as_torch_drops_it(tmp_path, watched):
    """A program that records two histories (the cs336 benchmark loops over its settings so): torch's
    allocator clears its trace when recording stops, so the second snapshot's trace holds only the
    second history's request, and one taken with recording off holds none; the blocks made before
    are live blocks of its segments. With --device-memory the audit records the whole run itself,
    and the program's snapshots are still what its own history holds."""
    script = tmp_path / "two.py"
    script.write_text(TWO_HISTORIES)
    snaps = [tmp_path / f"s{i}.pickle" for i in (1, 2, 3)]
    a = audit("run", str(script), "--to-end", "--no-profile", "--quiet",
              *(("--device-memory", "1") if watched else ()), "--", *map(str, snaps), out=tmp_path / "run")
    assert a.returncode == 0, a.stderr
    first, second, off = (load_snapshot(p) for p in snaps)
    allocs = [[(e.size, e.owner.line) for e in s.device_traces[0] if e.action == "alloc"] for s in (first, second)]
    assert allocs == [[(4 * MiB, 6)], [(2 * MiB, 11)]]
    assert off.device_traces[0] == []
    for snap in (second, off):
        live = sorted((b.requested_size, b.owner.line if b.owner else None)
                      for s in snap.segments for b in s.blocks if b.live)
        # (a block keeps the stack of the history it was made in, as torch keeps its context)
        assert live == [(2 * MiB, 11), (4 * MiB, 6), (8 * MiB, None)]
