"""The loss watch of an unchecked step on a GPU (Numerics._read_watched), on a machine without one.

An unchecked step's loss is read at its end: on a GPU it is copied to the host without waiting
and judged once a CUDA event recorded after the copy has completed, at that step's end or a later
one's. A one-element loss is judged by its value (one copy, where `isfinite` would launch four
kernels); a larger one by its `isfinite(...).all()` flag. Here the loss is a CPU tensor that says
it is a CUDA one, and torch.cuda.Event a stand-in whose completion the test decides: what is
checked is which step alarms the run, and when.
"""
from __future__ import annotations

import math

import pytest
import torch

from auditor.capture.numerics.collector import Numerics


class OnTheGpu(torch.Tensor):
    """A CPU tensor that answers as a CUDA one (is_cpu False, is_cuda True)."""

    @property
    def is_cpu(self) -> bool:
        return False

    @property
    def is_cuda(self) -> bool:
        return True


class Event:
    """torch.cuda.Event's stand-in: complete once the test says the device got there."""

    device_done = False
    recorded: list["Event"] = []

    def record(self) -> None:
        Event.recorded.append(self)

    def query(self) -> bool:
        return Event.device_done


ISFINITE: list[int] = []  # the sizes torch.isfinite was called on


@pytest.fixture
def watch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", Event)
    Event.device_done, Event.recorded = False, []
    isfinite = torch.isfinite
    ISFINITE.clear()
    monkeypatch.setattr(torch, "isfinite", lambda t: ISFINITE.append(t.numel()) or isfinite(t))
    return Numerics()


def step_end(col: Numerics, index: int, loss: torch.Tensor, device_done: bool) -> None:
    col.watched = loss.as_subclass(OnTheGpu)
    Event.device_done = device_done
    col._read_watched(index)


def alarms(col: Numerics) -> list[int]:
    return [e["step"] for e in col.events if e["event"] == "unchecked-nonfinite-loss"]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_gpu_loss_gone_wrong_alarms_at_its_own_step_once_its_copy_is_done(watch, bad):
    step_end(watch, 10, torch.tensor(2.5), device_done=True)
    step_end(watch, 11, torch.tensor(bad), device_done=False)  # (copied, not yet on the host)
    assert not watch.alarmed and len(watch.queued) == 1
    step_end(watch, 12, torch.tensor(1.0), device_done=True)
    assert watch.alarmed and alarms(watch) == [11]
    assert not watch.queued and len(Event.recorded) == 3  # (one event a step)
    assert watch.errors == 0 and ISFINITE == []  # (the value is copied: no isfinite on the device)


def test_finite_gpu_losses_never_alarm_whatever_their_dtype(watch):
    for i, loss in enumerate([torch.tensor(3.0), torch.tensor(0.0), torch.tensor(-1e30, dtype=torch.float64),
                              torch.tensor(60000.0, dtype=torch.float16), torch.tensor(1e38, dtype=torch.bfloat16),
                              torch.tensor([[0.25]])]):
        step_end(watch, i, loss, device_done=True)
    assert not watch.alarmed and not watch.queued and watch.errors == 0 and ISFINITE == []


def test_a_gpu_loss_of_several_elements_is_judged_by_its_isfinite_flag(watch):
    step_end(watch, 0, torch.tensor([1.0, 2.0, 3.0]), device_done=True)
    assert not watch.alarmed
    step_end(watch, 1, torch.tensor([1.0, math.nan, 3.0]), device_done=True)
    assert alarms(watch) == [1] and watch.errors == 0 and ISFINITE == [3, 3]
