"""What the numerics probes, the torch-function mode and the optimizer watch read and call on the
collector that installs them (`collector.Numerics` is the one implementation): they are typed by this
Protocol, so they need not import the collector that imports them."""
from __future__ import annotations

import weakref
from typing import Any, Callable, Protocol

import torch
from torch.overrides import TorchFunctionMode

from auditor.capture.numerics.values import Values


class Collector(Protocol):
    # the state of the run and of its step
    mode: TorchFunctionMode  # the checks' torch-function mode (mode._Mode)
    step: int  # the running step's index (-1: setup)
    in_step: bool
    checking: bool
    paused: int  # > 0 inside optimizer steps and the collector's own hooks
    in_backward: int  # > 0 while a backward pass the step started runs
    defer_cpu: bool
    check_s: float  # the checks' own time in this step
    # the step's records
    values: Values
    ops: list[tuple]
    losses: list[int]
    pending: dict[int, list[int]]
    aliases: dict[int, tuple[int, ...]]
    backward_fns: list[tuple[int, int, str]]
    # mixed precision
    scaler_index: weakref.WeakKeyDictionary[Any, int]
    scaled_ids: set[int]
    autocast_sites: dict[tuple, int]
    autocast_used: dict[int, int]
    autocast_next: tuple[int, dict[int, int]]  # (step, autocast site -> entries) carried to that step
    opt_steps: list[dict]  # the step's optimizer steps so far
    scaler_updates: list[tuple[int, int | None, int]]
    scale_calls: int
    # optimizers and schedulers
    opt_index: weakref.WeakKeyDictionary[Any, int]
    sched_index: weakref.WeakKeyDictionary[Any, int]
    scheds: list[tuple[weakref.ref, int]]

    def failed(self, e: BaseException) -> None: ...

    def event(self, kind: str, where: Any, **data: Any) -> None: ...

    def _stat(self, t: torch.Tensor) -> int: ...

    def on_op(self, func: Callable, kind: int, args: tuple, kwargs: dict, out: Any) -> None: ...

    def on_backward(self, args: tuple, kwargs: dict) -> None: ...

    def resolve_written(self, args: tuple, kwargs: dict) -> None: ...

    def alias(self, src: Any, out: Any) -> None: ...

    def _register_optimizer(self, opt: Any, where: Any) -> int: ...

    def param_name(self, p: torch.Tensor) -> str | None: ...

    def _names_of(self, params: list[torch.Tensor]) -> tuple[list[str], list[str], int]: ...
