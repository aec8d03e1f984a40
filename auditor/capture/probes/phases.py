"""The forward and optimizer phases: global module and optimizer-step hooks time the outermost
forward call and each optimizer step at the user's line (or a collector takes the timing over)."""
from __future__ import annotations

import sys
import warnings
from typing import Any

from torch.nn.modules import module as _nn_module

from auditor.capture.bench_switches import OFF
from auditor.capture.frames import library_code, user_frame, user_place
from auditor.capture.one_call import OneCall, compiled_anything
from auditor.capture.probes import graph_use
from auditor.capture.probes.optimizer_updates import update_begins, update_ends
from auditor.capture.probes.recorder import REC, FrameKey, settle_traced_steps, traced_optimizer_step
from auditor.capture.probes.wrappers import _compiling, _grad_on, perf
from auditor.evidence import model as m


_PHASE_HOOKS: list[Any] = []  # handles of the hooks below, while they are the ones timing the phases


def forward_done(module: Any, t0: float, where: FrameKey, output: Any = None, frame: Any = None) -> None:
    """An outermost module call (the forward phase), made at the user's line `where`, that started
    at `t0` has returned `output` (watched for whether a backward pass uses its graph: graph_use).
    A call the module makes of itself in a method of its own that the user's code called
    (`def get_action(self, x): ... self(x)`) is the line that called the method (_method_caller).
    `frame`: the user's frame `where` was read from, when the caller has it (no second walk)."""
    rec = REC
    if rec is not None and rec.active and not rec.in_data:
        where = _method_caller(module, where, frame)
        rec.add(m.FORWARD, type(module).__name__, where, (perf() - t0) * 1e3)
        if graph_use.Watch.on and _grad_on():
            try:
                graph_use.watch(module, output, where)
            except Exception:  # (the auditor's failure is never the user's: the graph goes unwatched)
                pass


def _method_caller(module: Any, where: FrameKey, frame: Any = None) -> FrameKey:
    """`where`, or the user's line that called the module's own method making the call at `where`
    (in `frame`, when given): an agent acts and trains through one method (cleanrl's SAC calls
    `actor.get_action(obs)` in its rollout and in its update), and only the method's callers tell
    a graph that is used from one that is not. A method called from library code (a framework's
    `training_step`) keeps its own line."""
    if not where:
        return where
    f: Any = frame if frame is not None else sys._getframe(2)
    while f is not None and (f.f_lineno != where[1] or f.f_code.co_filename != where[0]):
        f = f.f_back
    if f is None or f.f_code.co_name == "forward" or not f.f_code.co_argcount or f.f_code.co_varnames[0] != "self":
        return where
    if f.f_locals.get("self") is not module or f.f_back is None or library_code(f.f_back.f_code):
        return where
    return user_frame(f.f_back) or where


def optimizer_done(opt: Any, t0: float, where: FrameKey) -> None:
    """An optimizer step, called at the user's line `where`, that started at `t0` has returned."""
    rec = REC
    if rec is not None and rec.active:
        rec.add(m.OPTIMIZER, type(opt).__name__, where, (perf() - t0) * 1e3)


def take_over_phase_timing() -> bool:
    """Remove the probes' own forward and optimizer hooks, for a collector whose hooks run at the
    same points to time the phases instead (with `forward_done` and `optimizer_done`): every hook
    costs a Python call and torch's hook loop at every module call, about 0.1 ms a step on a small
    model. True if there were hooks to take over (the probes are installed)."""
    had = bool(_PHASE_HOOKS)
    for h in _PHASE_HOOKS:
        h.remove()
    _PHASE_HOOKS.clear()
    return had


def _install_phase_hooks() -> None:
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    state = {"depth": 0, "t0": 0.0, "opt_t0": 0.0}
    call = OneCall()
    light = "light" not in OFF

    def fwd_pre(module, args):
        if _compiling():  # (a compiled module's own call, torch.compile(model)'s, runs as it is: timed there)
            return
        if state["depth"] == 0:
            state["t0"] = perf()
            # only the outermost call's time is wanted: both hooks out for the calls inside it (as
            # the numerics collector's light call: one_call), where it has calls inside it
            if light and module._modules and type(module).__name__ != "OptimizedModule" and not compiled_anything():
                out = ((_nn_module._global_forward_pre_hooks, _PHASE_HOOKS[0].id, fwd_pre),
                       (_nn_module._global_forward_hooks, _PHASE_HOOKS[1].id, fwd_post))
                if call.watch(module, fwd_end, out):
                    return
        state["depth"] += 1

    def fwd_end(module, args, output):
        where, f = user_place(sys._getframe(1))
        forward_done(module, state["t0"], where, output, f)

    def fwd_post(module, args, output):
        if _compiling():
            return
        state["depth"] -= 1
        if state["depth"] == 0:
            forward_done(module, state["t0"], user_frame(sys._getframe(1)), output)

    def opt_pre(opt, args, kwargs):
        if _compiling():  # (traced into a compiled step: see traced_optimizer_step)
            traced_optimizer_step(opt)
            return
        settle_traced_steps()
        state["opt_t0"] = perf()
        return update_begins(opt, args, kwargs)

    def opt_post(opt, args, kwargs):
        if _compiling():
            return
        update_ends()
        optimizer_done(opt, state["opt_t0"], user_frame(sys._getframe(1)))

    # torch.compile warns that global hooks fire once more for its wrapper module: these are ours,
    # the user did nothing to act on (and both hooks count nested calls once)
    warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
    _PHASE_HOOKS.append(register_module_forward_pre_hook(fwd_pre))
    try:
        _PHASE_HOOKS.append(register_module_forward_hook(fwd_post, always_call=True))
    except TypeError:  # torch without always_call
        _PHASE_HOOKS.append(register_module_forward_hook(fwd_post))
    _PHASE_HOOKS.append(register_optimizer_step_pre_hook(opt_pre))
    _PHASE_HOOKS.append(register_optimizer_step_post_hook(opt_post))
