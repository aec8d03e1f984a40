"""A DataLoader's worker processes, as the audit sees them: each worker's CPU time a batch is timed
in the worker (the `data-worker` tallies), the worker runs the program's data code as a plain run
does (none of the audit's wrappers, global hooks or torch-function modes around its torch calls:
the CUDA rehearsal's mode made pytorch/examples mnist's worker take 2.5x its plain time a batch),
and a CUDA program rehearsed on a CPU whose workers cannot make its batches as fast as the GPU
would run its step is found waiting for data there (dataloader-bound, predicted), where its CPU
step is not."""
from __future__ import annotations

import json

import pytest

from conftest import audit

PROGRAM = '''\
import json, os, sys, time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPIN_MS = float(sys.argv[1])  # each sample's CPU work in the worker
OUT = sys.argv[2]  # the workers' own account, one line a sample
torch.manual_seed(0)


def spin(ms):
    t = time.thread_time()
    while time.thread_time() - t < ms / 1e3:
        pass


class Samples(Dataset):
    def __len__(self):
        return 4096

    def __getitem__(self, i):
        x = torch.randn(16, generator=torch.Generator().manual_seed(i)) * 2 + 1
        if not SPIN_MS:
            return x, i % 4
        t = time.thread_time()
        spin(SPIN_MS)
        x = x * 2 + 1
        modes = [type(m).__module__ for m in torch.overrides._get_current_function_mode_stack()]
        from torch.nn.modules import module as nn_module
        hooks = [getattr(h, "__module__", "") for h in (*nn_module._global_forward_pre_hooks.values(),
                                                         *nn_module._global_forward_hooks.values())]
        with open(OUT, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "ms": (time.thread_time() - t) * 1e3, "modes": modes,
                                "hooks": hooks, "wrapped": hasattr(torch.Tensor.to, "__audit_original__")}) + "\\n")
        return x, i % 4


loader = DataLoader(Samples(), batch_size=8, num_workers=2, persistent_workers=True)
model = nn.Linear(16, 4).to(DEVICE)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step, (x, y) in enumerate(loader):
    loss = F.cross_entropy(model(x.to(DEVICE)), y.to(DEVICE))
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.03)  # the step, on this CPU: longer than the workers take for a batch
    if step == 29:
        break
'''


def _run(tmp_path, spin_ms: float):
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    account = tmp_path / "samples.jsonl"
    a = audit("run", str(prog), "--steps", "30", "--no-profile", "--quiet", "--", str(spin_ms), str(account),
              out=tmp_path / "out", cwd=tmp_path)
    assert a.returncode == 0, a.stderr[-3000:]
    assert a.evidence["environment"]["rehearsal"]
    return a, [json.loads(line) for line in account.read_text().splitlines()] if account.exists() else []


@pytest.fixture(scope="module")
def slow_samples(tmp_path_factory):
    """1 ms of CPU a sample, 8 a batch, in 2 workers: 4 ms a batch at best, the GPU step ~0.1 ms."""
    return _run(tmp_path_factory.mktemp("slow"), 1.0)


@pytest.mark.slow
def test_the_workers_run_the_programs_data_code_as_a_plain_run_does(slow_samples):
    a, samples = slow_samples
    assert len({s["pid"] for s in samples}) == 2  # (made in the 2 workers)
    for s in samples:
        assert not any(m.startswith("auditor") for m in s["modes"]), s
        assert not any(h.startswith("auditor") for h in s["hooks"]), s
        assert not s["wrapped"], s


@pytest.mark.slow
def test_each_workers_cpu_time_a_batch_is_measured(slow_samples):
    a, samples = slow_samples
    tallies = [t for s in a.evidence["steps"] for t in s["tallies"] if t["kind"] == "data-worker"]
    assert tallies and {t["data"]["workers"] for t in tallies} == {2}
    batches = sum(t["data"]["batches"] for t in tallies)
    assert batches >= 29  # (a step's fetch reads what finished since the last: prefetched batches too)
    per_batch = sum(t["data"]["cpu_ms"] for t in tallies) / batches
    own = 8 * sum(s["ms"] for s in samples) / len(samples)  # the dataset's own CPU time for 8 samples
    # the fetch is the samples and the collate: at least the samples' own time, and not much more
    assert own <= per_batch <= 1.5 * own + 0.5, (per_batch, own)


@pytest.mark.slow
def test_a_rehearsed_step_that_its_workers_cannot_feed_on_the_gpu_waits_for_data(slow_samples):
    """Judged by the workers' CPU time a batch, which another process's load on the cores cannot
    move. The waits for batches measured here are wall time, which it stretches (the workers get less
    of a core): where they are longer than the workers' time, they set the predicted step and the
    step clock's floor (it failed on a loaded machine: `data_supply_ms` None)."""
    a, _ = slow_samples
    [f] = a.rule("dataloader-bound")
    ev = f["evidence"]
    # 8 ms of CPU a batch over 2 workers: a batch every 4 ms at least, for a step of a few launches
    assert ev["worker_cpu_ms_per_batch"] >= 8.0 and ev["workers_ms_per_step"] == pytest.approx(
        ev["worker_cpu_ms_per_batch"] / 2, rel=0.01)
    supply = ev["workers_ms_per_step"]
    assert ev["predicted_gpu_step_ms"] >= 0.95 * supply
    assert f["cost"]["measured"] is False and f["cost"]["ms_per_step"] >= 0.9 * supply - 0.5
    assert f["message"].startswith("On the GPU the steps would wait for data: add DataLoader workers. On the GPU this "
                                    "step would take ") and " of it waiting for data" in f["message"]
    assert "its 2 worker processes take" in f["message"] and "each on a core of its own" in f["fix"]["summary"]
    assert f["fix"]["config"]["DataLoader.num_workers"] == 8  # (dozens needed: the most it advises)
    assert f["locations"][0]["line"] == PROGRAM.splitlines().index(
        "loader = DataLoader(Samples(), batch_size=8, num_workers=2, persistent_workers=True)") + 1
    clock = a.findings_doc["steps"]["clock"]
    assert clock["issue_floor_ms"] >= 0.999 * supply
    if clock["issue_floor_ms"] <= supply / 0.999:  # (the waits measured here are not longer: an unloaded machine)
        assert ev["predicted_gpu_step_ms"] == pytest.approx(supply, rel=0.05)
        assert clock["data_supply_ms"] == pytest.approx(supply, rel=0.01)
        assert "waiting for its batches: its DataLoader's workers take" in (a.out / "summary.txt").read_text()
    else:
        assert clock["data_supply_ms"] is None


@pytest.mark.slow
def test_workers_that_keep_up_leave_the_rehearsed_step_unflagged(tmp_path):
    """The same loader making each sample in a few microseconds: its workers' batches are timed,
    and they keep up with the GPU's step."""
    a, _ = _run(tmp_path, 0.0)
    tallies = [t for s in a.evidence["steps"] for t in s["tallies"] if t["kind"] == "data-worker"]
    assert sum(t["data"]["batches"] for t in tallies) >= 29
    assert a.rule("dataloader-bound") == []


LOOKAHEAD = '''\
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def ahead(loader):
    """Accelerate's DataLoaderShard's shape: each batch is handed out once the next one is fetched."""
    it = iter(loader)
    current = next(it)
    for batch in it:
        yield current
        current = batch
    yield current


loader = DataLoader(TensorDataset(torch.randn(512, 8), torch.randn(512, 1)), batch_size=16, num_workers=2)
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for x, y in ahead(loader):
    loss = F.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


@pytest.mark.slow
def test_the_workers_account_is_no_work_of_the_step_that_fetched_it(tmp_path):
    """A loader fetched one batch ahead (Hugging Face's Trainer, through Accelerate) with workers:
    the first step fetches twice before its first optimizer step. The workers' account, read at
    each fetch, is the loader's, not the step's own work: it closed step 0 at the second fetch (a
    step of one fetch, then '0.9 optimizer steps per iteration')."""
    prog = tmp_path / "prog.py"
    prog.write_text(LOOKAHEAD)
    a = audit("run", str(prog), "--steps", "12", "--no-profile", "--quiet", out=tmp_path / "out", cwd=tmp_path)
    assert a.returncode == 0, a.stderr[-3000:]
    steps = a.evidence["steps"]
    assert [sum(t["count"] for t in s["tallies"] if t["kind"] == "optimizer") for s in steps] == [1] * 12
    assert any(t["kind"] == "data-worker" for s in steps for t in s["tallies"])
    assert "steps: optimizer steps (SGD), 1 per iteration" in (a.out / "summary.txt").read_text()
