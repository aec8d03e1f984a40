"""The launch counter of CUDA rehearsal (auditor.capture.rehearsal.launches), in-process: what
counts as a kernel launch, what a launch is said to move, and that counting never fails a call.
Its counts on a real rehearsed trainer are tested with launch-bound (tests/rules/test_launch_bound_rehearsal.py)."""
from __future__ import annotations

import sys
import warnings

import pytest
import torch

from auditor.capture import probes
from auditor.capture.rehearsal import launches
from auditor.evidence import model as m

_T = torch._C.TensorBase


@pytest.fixture
def rec(monkeypatch):
    r = probes.Recorder()
    monkeypatch.setattr(probes, "REC", r)
    return r


def counted(rec) -> list[dict]:
    return [t for t in rec.drain() if t["kind"] == m.DEVICE_LAUNCH]


@pytest.mark.parametrize("func,name", [
    (_T.mul_, "Tensor.mul_"), (torch.tanh, "torch.tanh"), (torch._C._nn.linear, "F.linear"),
    (_T.add, "Tensor.add"), (torch.stack, "torch.stack"),
])
def test_computing_calls_are_launches(func, name):
    assert launches.launch_name(func) == name


@pytest.mark.parametrize("func", [_T.view, _T.reshape, _T.detach, _T.t, _T.transpose, _T.expand, _T.size,
                                  _T.as_strided, _T.item, _T.grad.__get__, torch.empty])
def test_views_metadata_and_host_reads_are_not(func):
    assert launches.launch_name(func) is None


def test_a_launch_moves_its_inputs_and_outputs_at_the_callers_line(rec):
    a, b = torch.ones(8, 4), torch.ones(8, 4)
    out = a + b
    for _ in range(2):  # one line: one tally
        launches.count("Tensor.add", (a, b), out, sys._getframe())
    launches.count("Tensor.new_zeros", (a, 8, 4), torch.zeros(8, 4), sys._getframe())  # reads a's shape only
    (add, zeros) = sorted(counted(rec), key=lambda t: t["what"])
    assert add["count"] == 2 and add["data"]["bytes"] == 2 * 3 * 8 * 4 * 4
    assert add["where"]["file"] == __file__ and add["where"]["function"] == (
        "test_a_launch_moves_its_inputs_and_outputs_at_the_callers_line")
    assert zeros["data"]["bytes"] == 8 * 4 * 4


def test_basic_indexing_is_a_view_and_tensor_indexing_a_launch(rec):
    x = torch.randn(4, 6)
    launches.count("Tensor.__getitem__", (x, (slice(None), 2)), x[:, 2], sys._getframe())
    assert counted(rec) == []
    idx = torch.tensor([0, 2])
    launches.count("Tensor.__getitem__", (x, idx), x[idx], sys._getframe())
    assert [t["count"] for t in counted(rec)] == [1]


def test_a_sparse_tensor_is_counted_by_what_it_stores(rec):
    """A sparse COO tensor has no `nbytes` (RuntimeError): the user's call must not fail on it, and
    it moves its stored values and their indices, not the size of its dense shape."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, 2.0]), (2, 2))
        out = (s + s).coalesce()
    launches.count("torch.add", (s, s), out, sys._getframe())
    (t,) = counted(rec)
    stored = 2 * 4 + 2 * 2 * 8  # two float32 values, their two int64 indices each
    assert t["count"] == 1 and t["data"]["bytes"] == 3 * stored


def test_torch_optims_own_calls_are_not_counted(rec):
    """A call made by torch.optim's code (SGD's per-parameter `param.add_`, what a CPU run takes
    where a GPU takes the foreach path) is not counted; the same call from the user's code is."""
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    frames = []

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "_single_tensor_sgd":
            frames.append(frame)

    sys.setprofile(tracer)
    try:
        torch.optim.SGD([p], lr=0.1, foreach=False).step()
    finally:
        sys.setprofile(None)
    assert frames
    launches.count("Tensor.add_", (p, p.grad), p, frames[0])
    assert counted(rec) == []
    launches.count("Tensor.add_", (p, p.grad), p, sys._getframe())
    assert [t["count"] for t in counted(rec)] == [1]
