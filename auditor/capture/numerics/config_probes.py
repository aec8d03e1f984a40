"""Probes on Optimizer/LRScheduler construction and `load_state_dict`, zero_grad, a scheduler's
step and batch loading: they record the configuration the rules compare with what the run really
did. Each probe calls the original first and only reads.
"""
from __future__ import annotations

import functools
import sys
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch

from auditor.capture import probes
from auditor.capture.frames import user_frame
from auditor.capture.numerics.stack import _compiling, _pop_mode, _push_mode, _top_mode
from auditor.capture.numerics.values import _plain, _scalar
from auditor.capture.unseen import no_torch_function as _no_torch_function

if TYPE_CHECKING:
    from auditor.capture.numerics.collector_api import Collector


def _wrap(owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    orig = owner.__dict__.get(name)
    if orig is None or getattr(orig, "__audit_numerics__", False):
        return
    new = make(orig)
    functools.update_wrapper(new, orig)
    new.__audit_numerics__ = True
    setattr(owner, name, new)


def _caller() -> Any:
    return user_frame(sys._getframe(2))


def guard_of(col: Collector) -> Callable[[Callable], Callable]:
    """A decorator for the probes' own reads: the collector paused, torch-function dispatch off,
    and a failure counted by the collector instead of raised in the user's step."""

    def guard(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def safe(*a: Any, **k: Any) -> None:
            try:
                col.paused += 1
                with _no_torch_function():  # (reads of the user's objects: unseen by the user's modes)
                    fn(*a, **k)
            except Exception as e:
                col.failed(e)
            finally:
                col.paused -= 1
        return safe
    return guard


def install_config_probes(col: Collector) -> None:
    """Record what the configuration says: optimizer and scheduler construction and state loads.
    Each probe calls the original first and only reads."""
    guard = guard_of(col)
    _outside_mode_probes(col)
    _optimizer_probes(col, guard)
    _scheduler_probes(col, guard)


def _outside_mode_probes(col: Collector) -> None:
    """Batch loading and zero_grad, run with the collector's mode off."""
    from torch.optim import Optimizer
    import torch.utils.data.dataloader as dl

    def make_outside_mode(orig):
        # Batch loading (thousands of indexing calls, none the model's) and zero_grad (two
        # attribute calls per parameter, which cannot make a non-finite value) run with the mode off.
        def probe(self, *args, **kwargs):
            if _compiling():  # (traced by torch.compile: the call as it is, see probes._compiling)
                return orig(self, *args, **kwargs)
            if col.in_step and _top_mode() is col.mode:
                _pop_mode()  # (torch.overrides._pop_mode_temporarily, without its generator: every step)
                try:
                    return orig(self, *args, **kwargs)
                finally:
                    _push_mode(col.mode)
            return orig(self, *args, **kwargs)
        return probe

    def make_zero_grad(orig):
        outside = make_outside_mode(orig)

        def probe(self, *args, **kwargs):
            probes.settle_traced_steps()  # (a compiled step's gradients, read before they go)
            return outside(self, *args, **kwargs)
        return probe

    _wrap(dl._BaseDataLoaderIter, "__next__", make_outside_mode)
    _wrap(Optimizer, "zero_grad", make_zero_grad)
    _wrap(torch.nn.Module, "zero_grad", make_zero_grad)


def _optimizer_probes(col: Collector, guard: Callable[[Callable], Callable]) -> None:
    """Each optimizer made, and its learning rates before and after a `load_state_dict`."""
    from torch.optim import Optimizer

    @guard
    def after_opt_init(self, where) -> None:
        if self not in col.opt_index:
            col._register_optimizer(self, where)

    def make_opt_init(orig):
        def probe(self, *args, **kwargs):
            where = _caller()
            orig(self, *args, **kwargs)
            after_opt_init(self, where)
        return probe

    @guard
    def after_opt_load(self, before, where) -> None:
        idx = col.opt_index.get(self)
        if idx is None:
            idx = col._register_optimizer(self, None)
        col.event("optimizer.load_state_dict", where, opt=idx, lr_before=before,
                  lr_after=[_scalar(g.get("lr")) for g in self.param_groups],
                  initial_lr_after=[_scalar(g.get("initial_lr")) for g in self.param_groups])

    def make_opt_load(orig):
        def probe(self, state_dict, *args, **kwargs):
            where = _caller()
            with _no_torch_function():
                before = [_scalar(g.get("lr")) for g in self.param_groups]
            result = orig(self, state_dict, *args, **kwargs)
            after_opt_load(self, before, where)
            return result
        return probe

    _wrap(Optimizer, "__init__", make_opt_init)
    _wrap(Optimizer, "load_state_dict", make_opt_load)


def _scheduler_probes(col: Collector, guard: Callable[[Callable], Callable]) -> None:
    """Each LR scheduler made (its type and settings), its state loads, and its steps."""
    from torch.optim import lr_scheduler

    @guard
    def after_sched_init(self, where) -> None:
        if self in col.sched_index:
            return
        idx = len(col.sched_index)
        col.sched_index[self] = idx
        col.scheds.append((weakref.ref(self), idx))
        opt = getattr(self, "optimizer", None)
        attrs = _plain({k: v for k, v in vars(self).items() if not k.startswith("_") and k not in
                        ("optimizer", "base_lrs", "last_epoch", "verbose")})
        milestones = getattr(self, "milestones", None)
        if isinstance(milestones, dict):  # MultiStepLR keeps a Counter
            attrs["milestones"] = sorted(int(k) for k, n in milestones.items() for _ in range(int(n)))
        groups = opt.param_groups if opt is not None else []
        if any("max_lr" in g for g in groups):  # OneCycleLR keeps its peak in the param groups
            attrs["group_max_lrs"] = [_scalar(g.get("max_lr")) for g in groups]
        col.event("scheduler", where, sched=idx, type=type(self).__name__,
                  opt=col.opt_index.get(opt) if opt is not None else None, attrs=attrs,
                  base_lrs=[_scalar(x) for x in getattr(self, "base_lrs", [])],
                  last_epoch=getattr(self, "last_epoch", None),
                  group_lrs=[_scalar(g.get("lr")) for g in opt.param_groups] if opt is not None else [])

    def make_sched_init(orig):
        def probe(self, *args, **kwargs):
            where = _caller()
            orig(self, *args, **kwargs)
            after_sched_init(self, where)
        return probe

    @guard
    def after_sched_load(self, before, where) -> None:
        col.event("scheduler.load_state_dict", where, sched=col.sched_index.get(self), type=type(self).__name__,
                  base_lrs_before=before[0], last_epoch_before=before[1],
                  base_lrs_after=[_scalar(x) for x in getattr(self, "base_lrs", [])],
                  last_epoch_after=getattr(self, "last_epoch", None))

    def make_sched_load(orig):
        def probe(self, state_dict, *args, **kwargs):
            where = _caller()
            with _no_torch_function():
                before = ([_scalar(x) for x in getattr(self, "base_lrs", [])], getattr(self, "last_epoch", None))
            result = orig(self, state_dict, *args, **kwargs)
            after_sched_load(self, before, where)
            return result
        return probe

    def make_sched_step(orig):
        def probe(self, *args, **kwargs):
            if not _compiling():
                probes.settle_traced_steps()  # (a compiled step's learning rates, read before they change)
            return orig(self, *args, **kwargs)
        return probe

    _wrap(lr_scheduler.LRScheduler, "__init__", make_sched_init)
    _wrap(lr_scheduler.LRScheduler, "step", make_sched_step)
    for wrapper in ("SequentialLR", "ChainedScheduler", "ReduceLROnPlateau"):  # no LRScheduler.__init__, .step
        cls = getattr(lr_scheduler, wrapper, None)
        if cls is not None:
            _wrap(cls, "__init__", make_sched_init)
            _wrap(cls, "step", make_sched_step)
    _wrap(lr_scheduler.LRScheduler, "load_state_dict", make_sched_load)
