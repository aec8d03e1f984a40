"""manual-update on profiler traces (`audit analyze`, and the profiler window of `audit run` on a CUDA
machine): parameter-shaped in-place updates outside every `Optimizer.step#...` range.

The controls are the GPU recordings: ResNet-50 on a V100 (torch 1.9 SGD: its `aten::add_` /
`aten::mul_` on parameter shapes run inside `Optimizer.step#SGD.step`, and backward's gradient
accumulation adds parameter-shaped gradients inside `AccumulateGrad`), the A100 TorchRec rank
(FusedAdam; a running metric's `add_` on `[1]` counters every step) and the A100 DDP rank (SGD, no
shapes recorded). No recording holds a hand-written update loop on a GPU, and this machine has none:
the positive case is a trace recorded here, on the CPU, by torch.profiler with shapes and stacks as
`audit run` records its window, of a 3-layer MLP updated by `p.add_(p.grad, alpha=-lr)` over its
parameters (and its twin stepping torch.optim.SGD). A CPU op launches no kernel, so these are judged
with `launched_only=False`: the one predicate changed is "it launched a kernel"; every other part
of the judgement (parameter shapes from the layers' `Input Dims`, the optimizer and backward ranges,
the counts and coverage, the Python frame) runs as on a GPU trace."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import FIXTURES

from auditor.evidence.model import Evidence
from auditor.evidence.trace.load import load_trace
from auditor.rules.engine import skip_reason
from auditor.rules.manual_update import ManualUpdate, manual_updates

TRACES = FIXTURES / "traces"
CONTROLS = ["v100_resnet50_dataloader_workers0.pt.trace.json.gz", "a100_rank0_cpu_item_cudagraphs.pt.trace.json.gz",
            "a100_ddp_nccl_2rank.pt.trace.json.gz", "h100_owlv2_syncs_dataloader.pt.trace.json.gz"]
LR = 0.01
# (torch.profiler's note on a schedule's cycles, about the recording, not the code under test)
pytestmark = pytest.mark.filterwarnings("ignore:Warning. Profiler clears events")


def _train(model: nn.Module, opt: torch.optim.Optimizer | None) -> None:
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    if opt is None:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-LR)
                p.grad = None
    else:
        opt.step()
        opt.zero_grad()


def _record(path: Path, with_optimizer: bool) -> Path:
    """Three steps of the MLP under torch.profiler (one warm-up), shapes and stacks on, as the
    profiler window of `audit run` records them."""
    from torch.profiler import ProfilerActivity, profile, schedule

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=LR) if with_optimizer else None
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True,
                 schedule=schedule(wait=0, warmup=1, active=3),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for _ in range(4):
            _train(model, opt)
            prof.step()
    return path


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("cpu_traces")
    return {"loop": _record(d / "manual_loop.pt.trace.json", False),
            "optimizer": _record(d / "sgd.pt.trace.json", True)}


def test_a_hand_written_update_loop_in_a_recorded_trace(recorded) -> None:
    trace = load_trace(recorded["loop"])
    rule = ManualUpdate()
    # on the GPU each update launches a kernel; recorded on the CPU, none does
    assert rule.check_trace(trace, rule.default_options()) is None
    f = rule.check_trace(trace, rule.default_options(), launched_only=False)
    assert f is not None
    ev = f.evidence
    # 3 Linear layers: 6 parameters of 5 shapes (two 128-wide biases), each updated once a step
    assert ev["steps"] == 3 and ev["steps_with_updates"] == 3 and ev["updates"] == 18
    assert ev["updates_per_step"] == 6.0 and ev["ops"] == {"aten::add_": 18}
    assert ev["shapes_updated"] == ev["parameter_shapes"] == 5
    rows, _ = manual_updates(trace, launched_only=False)
    assert ev["host_ms_per_step"] == round(float(trace.col("dur")[rows].sum()) / 1000 / 3, 3) == f.cost.ms_per_step
    # torch >= 2 traces name a Python function by its file's name and def line; the one line of
    # _train's body that calls add_ (what ran below the frame) is where the update is
    here = Path(__file__)
    add_line = next(i for i, text in enumerate(here.read_text().splitlines(), 1)
                    if text.strip() == "p.add_(p.grad, alpha=-LR)")
    assert [(loc.file, loc.line) for loc in f.locations] == [(here.name, add_line)]
    assert f.fix.config == {"optimizer": {"foreach": True}}


def test_the_same_model_stepping_an_optimizer_is_silent(recorded) -> None:
    trace = load_trace(recorded["optimizer"])
    assert len(manual_updates(trace, launched_only=False)[0]) == 0  # its add_ run inside Optimizer.step#SGD.step
    assert ManualUpdate().check_trace(trace, ManualUpdate.default_options(), launched_only=False) is None


@pytest.mark.parametrize("name", CONTROLS)
def test_silent_on_the_gpu_recordings(name: str) -> None:
    ev = Evidence(source="trace", traces=[str(TRACES / name)])
    ev.__dict__["trace_data"] = [load_trace(TRACES / name)]
    rule = ManualUpdate()
    assert skip_reason(rule, ev) is None
    assert list(rule.check(ev, rule.default_options())) == []
    # nor with the kernel predicate off: what keeps them silent is the optimizer and backward
    # ranges, the parameter shapes and their coverage
    assert rule.check_trace(ev.trace_data[0], rule.default_options(), launched_only=False) is None
