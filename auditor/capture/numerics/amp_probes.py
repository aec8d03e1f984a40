"""Probes on autocast, GradScaler and gradient clipping: which autocast regions ran, the loss scale
before and after each update, clipping of gradients a GradScaler has not unscaled yet, and the
max_norm each optimizer's gradients are clipped to."""
from __future__ import annotations

import sys
import weakref
from typing import TYPE_CHECKING, Any

import torch

from auditor.capture.frames import library_code, user_frame
from auditor.capture.numerics.config_probes import _caller, _wrap, guard_of
from auditor.capture.numerics.tensors import _checkable
from auditor.capture.numerics.values import _scalar
from auditor.capture.unseen import no_torch_function as _no_torch_function

if TYPE_CHECKING:
    from auditor.capture.numerics.collector_api import Collector


def _name_in(frame: Any, obj: Any) -> str | None:
    """The name `obj` has in the user's frame (a local, an attribute of `self`, a global), for a fix."""
    if obj is None or frame is None:
        return None
    for k, v in frame.f_locals.items():
        if v is obj:
            return k
    owner = frame.f_locals.get("self")
    for k, v in (getattr(owner, "__dict__", None) or {}).items():
        if v is obj:
            return f"self.{k}"
    return next((k for k, v in frame.f_globals.items() if v is obj), None)


def _user_frame_object(frame: Any) -> Any:
    while frame is not None and library_code(frame.f_code):
        frame = frame.f_back
    return frame


def install_amp_probes(col: Collector) -> None:
    """Record GradScaler use, autocast regions and clipping of scaled gradients."""
    guard = guard_of(col)
    # The scale a GradScaler put in the gradients (scale(loss).backward()) is in them until
    # unscale_(opt), or step(opt), which unscales first: scaler -> ids of the optimizers it has
    # unscaled since its last scale(). Clipping before that clips scaled gradients.
    scaled: "weakref.WeakKeyDictionary[Any, set[int]]" = weakref.WeakKeyDictionary()
    _autocast_probes(col, guard)
    _unscaling_probes(col, scaled)
    _scaler_probes(col, guard, scaled)
    _clip_probes(col, guard, scaled)


def _autocast_probes(col: Collector, guard: Any) -> None:
    """Each autocast region entered: its site once, and how often the step used it."""
    from torch.amp import autocast_mode

    @guard
    def after_enter(self, where) -> None:
        dtype = getattr(self, "fast_dtype", None)
        key = (where, str(dtype), str(getattr(self, "device", "")))
        sid = col.autocast_sites.get(key)
        if sid is None:
            sid = col.autocast_sites[key] = len(col.autocast_sites)
            col.event("autocast", where, site=sid, dtype=str(dtype).replace("torch.", ""),
                      device=str(getattr(self, "device", "")), enabled=bool(getattr(self, "_enabled", True)))
        if col.in_step and getattr(self, "_enabled", True):
            if col.opt_steps:  # entered after the step's update: the next iteration's region (its
                # forward is what ends this step), counted in that step if it is checked
                step, used = col.autocast_next
                if step != col.step + 1:
                    used = {}
                    col.autocast_next = (col.step + 1, used)
                used[sid] = used.get(sid, 0) + 1
            else:
                col.autocast_used[sid] = col.autocast_used.get(sid, 0) + 1

    def make_enter(orig):
        def probe(self, *args, **kwargs):
            where = _caller()
            result = orig(self, *args, **kwargs)
            after_enter(self, where)
            return result
        return probe

    _wrap(autocast_mode.autocast, "__enter__", make_enter)


def _unscaling_probes(col: Collector, scaled: "weakref.WeakKeyDictionary[Any, set[int]]") -> None:
    """GradScaler.unscale_ and step: the optimizers unscaled since the last scale(); the scaler's own
    inf checks are not checked as the model's."""
    from torch.amp import grad_scaler

    def make_paused(orig):
        def probe(self, *args, **kwargs):  # the scaler's own inf checks are not the model's
            col.paused += 1
            try:
                return orig(self, *args, **kwargs)
            finally:
                col.paused -= 1
        return probe

    def make_unscaling(orig):
        paused = make_paused(orig)

        def probe(self, optimizer, *args, **kwargs):
            result = paused(self, optimizer, *args, **kwargs)
            done = scaled.get(self)
            if done is not None:
                done.add(id(optimizer))
            return result
        return probe

    _wrap(grad_scaler.GradScaler, "unscale_", make_unscaling)
    _wrap(grad_scaler.GradScaler, "step", make_unscaling)


def _scaler_probes(col: Collector, guard: Any, scaled: "weakref.WeakKeyDictionary[Any, set[int]]") -> None:
    """Each GradScaler made, the unscaled loss it scales, and its scale before and after each update."""
    from torch.amp import grad_scaler

    @guard
    def after_scaler_init(self, where) -> None:
        idx = len(col.scaler_index)
        col.scaler_index[self] = idx
        col.event("grad_scaler", where, scaler=idx, enabled=bool(getattr(self, "_enabled", True)),
                  device=str(getattr(self, "_device", "")), init_scale=_scalar(getattr(self, "_init_scale", None)),
                  growth_interval=_scalar(getattr(self, "_growth_interval", None)),
                  backoff_factor=_scalar(getattr(self, "_backoff_factor", None)))

    def make_scaler_init(orig):
        def probe(self, *args, **kwargs):
            where = _caller()
            orig(self, *args, **kwargs)
            after_scaler_init(self, where)
        return probe

    @guard
    def after_scale(self, outputs, result) -> None:
        if not col.in_step or not getattr(self, "_enabled", True):
            return
        col.scale_calls += 1
        scaled[self] = set()
        if isinstance(outputs, torch.Tensor) and _checkable(outputs) and isinstance(result, torch.Tensor):
            with torch.no_grad():
                col.losses.append(col._stat(outputs))  # the unscaled loss
            col.scaled_ids.add(id(result))

    def make_scale(orig):
        def probe(self, outputs, *args, **kwargs):
            result = orig(self, outputs, *args, **kwargs)
            after_scale(self, outputs, result)
            return result
        return probe

    def read_scale(self) -> int | None:
        s = getattr(self, "_scale", None)
        return col.values.add(s.detach().reshape(()).clone()) if isinstance(s, torch.Tensor) else None

    def make_update(orig):
        def probe(self, *args, **kwargs):
            scaled.pop(self, None)  # (the step is over: its gradients are used)
            if not (col.in_step and getattr(self, "_enabled", True) and col.checking):
                return orig(self, *args, **kwargs)
            before = None
            try:
                with torch.no_grad(), _no_torch_function():
                    before = read_scale(self)
            except Exception as e:
                col.failed(e)
            col.paused += 1
            try:
                result = orig(self, *args, **kwargs)
            finally:
                col.paused -= 1
            try:
                with torch.no_grad(), _no_torch_function():
                    after = read_scale(self)
                if after is not None:
                    idx = col.scaler_index.get(self)
                    col.scaler_updates.append((idx if idx is not None else -1, before, after))
            except Exception as e:
                col.failed(e)
            return result
        return probe

    _wrap(grad_scaler.GradScaler, "__init__", make_scaler_init)
    _wrap(grad_scaler.GradScaler, "scale", make_scale)
    _wrap(grad_scaler.GradScaler, "update", make_update)


def _clip_probes(col: Collector, guard: Any, scaled: "weakref.WeakKeyDictionary[Any, set[int]]") -> None:
    """clip_grad_norm_/clip_grad_value_: each optimizer's max_norm, and clipping of scaled gradients."""
    import torch.nn.utils as nn_utils
    import torch.nn.utils.clip_grad as clip_grad

    @guard
    def after_clip(params: list, what: str, limit: Any, frame: Any) -> None:
        first = next((p for p in params if isinstance(p, torch.Tensor)), None)
        if first is None:
            return
        opt = next((o for o in list(col.opt_index.keys())
                    if any(p is first for g in o.param_groups for p in g["params"])), None)
        for scaler, done in list(scaled.items()):
            if id(opt) in done if opt is not None else bool(done):
                continue
            user = _user_frame_object(frame)
            col.event("clip_scaled", user_frame(frame), fn=what, scaler=col.scaler_index.get(scaler),
                      opt=col.opt_index.get(opt) if opt is not None else None, limit=_scalar(limit),
                      scaler_name=_name_in(user, scaler), opt_name=_name_in(user, opt))
            return

    clips: set[tuple] = set()

    @guard
    def note_clip(params: list, limit: Any, norm_type: Any, frame: Any) -> None:
        """A `clip_grad_norm_` of an optimizer's parameters, once per (optimizer, max_norm,
        norm_type): the norm grad-explosion measures at `optimizer.step()` is after it, and a norm
        at its max_norm is the program's clip at work, not a norm of that size."""
        first = next((p for p in params if isinstance(p, torch.Tensor)), None)
        if first is None:
            return
        opt = next((o for o in list(col.opt_index.keys())
                    if any(p is first for g in o.param_groups for p in g["params"])), None)
        key = (col.opt_index.get(opt) if opt is not None else None, _scalar(limit), _scalar(norm_type))
        if key in clips:
            return
        clips.add(key)
        col.event("clip", user_frame(frame), fn="clip_grad_norm_", opt=key[0], limit=key[1], norm_type=key[2])

    def make_clip(orig, what: str, limit_name: str):
        def probe(parameters, *args, **kwargs):
            if not (col.in_step and not col.paused):
                return orig(parameters, *args, **kwargs)
            # (a generator of parameters is read once, here, and handed on as the list it gave)
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            limit = args[0] if args else kwargs.get(limit_name)
            if what == "clip_grad_norm_":
                note_clip(params, limit, args[1] if len(args) > 1 else kwargs.get("norm_type", 2.0), sys._getframe(1))
            if scaled:
                after_clip(params, what, limit, sys._getframe(1))
            return orig(params, *args, **kwargs)
        return probe

    for owner in (nn_utils, clip_grad):
        _wrap(owner, "clip_grad_norm_", lambda orig: make_clip(orig, "clip_grad_norm_", "max_norm"))
        _wrap(owner, "clip_grad_value_", lambda orig: make_clip(orig, "clip_grad_value_", "clip_value"))
