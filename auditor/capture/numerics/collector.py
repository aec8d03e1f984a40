"""The numerics collector: one per child process, told when each step begins and ends.

* While a step runs it pushes the mode (mode.py), which hands each torch call to `on_op`.
* Global module pre/post forward hooks keep the stack of running modules. A library leaf module
  (nn.Linear, a loss) is checked as one op by these hooks, the mode off for its forward: most calls
  happen inside such modules, and the mode's dispatch is the largest fixed cost of a check.
* A call of code torch.compile compiled runs with the mode off the stack (unseen.compiled_calls_without)
  and is checked as one call at the user's line (`_compiled_call_ran`); its backward's loss is
  checked by the backward probe (`_backward_in_compiled_call`).
* The module and optimizer hooks also time the forward and optimizer phases for the probes
  (`probes.take_over_phase_timing`).
The class is assembled from mixins sharing this object's state: sites.py, deferral.py,
optimizer.py, record.py, origin.py; the per-op path (`on_op`, `_record`, `_stat`, the module
hooks) is here. Every check runs under `torch.no_grad()` and only reads the user's tensors; a
check that fails is switched off (counted in `errors`), never allowed to fail the step.
"""
from __future__ import annotations

import math
import sys
import weakref
from typing import Any, Callable

import torch
from torch.nn.modules import module as _nn_module

from auditor.capture import probes, torch_private
from auditor.capture.bench_switches import OFF, TOGGLED, off
from auditor.capture.frames import user_call, user_frame, user_place
from auditor.capture.one_call import OneCall
from auditor.capture.one_call import compiled_anything as _compiled_anything
from auditor.capture.numerics.amp_probes import install_amp_probes
from auditor.capture.numerics.backward_probe import install_backward_probe
from auditor.capture.numerics.config_probes import install_config_probes
from auditor.capture.numerics.deferral import COLLECTORS, Deferral
from auditor.capture.numerics.mode import _Mode
from auditor.capture.numerics.ops import (COMPILED, DIV, EXP, LOG, LOG1P, NORM, PLAIN, POW, RDIV, SQRT,
                                          HAZARD_NAMES, _LEAF_MONOTONE, _library_module, _library_types,
                                          _monotone, _mutates, _neg)
from auditor.capture.numerics.optimizer import OptimizerWatch, _OptPlan
from auditor.capture.numerics.origin import Origins
from auditor.capture.numerics.record import StepRecordBuilder
from auditor.capture.numerics.schedule import CHECK_EVERY, CHECKS_BUDGET, DENSE_STEPS, Spacing, dense_steps
from auditor.capture.numerics.schedule import checked as _scheduled
from auditor.capture.numerics.sites import Tables
from auditor.capture.numerics.stack import (CHECKS_RANGE, _checks_range, _compiling, _pop_mode, _profiling,
                                            _push_mode, _set_grad, _stack_at, _stack_len, _top_mode, perf)
from auditor.capture.numerics.tensors import (_HALF, _PLAIN_TYPES, _checkable, _real, _stored, _tensor_args,
                                              _tensor_refs, _tensors_in, _version_of)
from auditor.capture.numerics.values import _TB, Values, _finite
from auditor.capture.unseen import (compiled_calls_without, dynamo_skips_our_frames, in_compiled_call,
                                    no_torch_function as _no_torch_function, quietly)

MAX_OPS_PER_STEP = 20000  # records kept per step; later calls are counted as dropped
MAX_ERRORS = 20  # after this many failures of our own checking code, op checking switches off
_FIND = object()  # _record: find the user's line from the stack
# A cached range's version that matches no tensor's (-1 is an inference tensor's): the range of an
# argument as it was before compiled code that may have written into it unseen (see
# _compiled_call_ran), still read as the call's input, never as the tensor's current value.
_BEFORE_UNSEEN_WRITE = -2


class Numerics(Tables, Deferral, OptimizerWatch, StepRecordBuilder, Origins):
    """Collector (see auditor.capture.collectors): one per child process."""

    name = "numerics"

    def __init__(self) -> None:
        self.mode = _Mode(self)
        self.step: int = -1  # -1: setup (module import), before the first step
        self.in_step = False
        self.checking = True
        self.paused = 0  # > 0 inside optimizer steps and our own hooks
        self.mode_popped = 0  # > 0 while an optimizer step has taken the mode off the stack
        self.in_backward = 0  # > 0 while a backward pass the step started (through the mode) runs
        self.errors = 0
        self.error_text: str | None = None
        self.check_s = 0.0
        # tables, sent incrementally
        self.sites: dict[tuple, int] = {}
        self.instr_sites: dict[tuple, int] = {}  # (op, id of the user's code object, instruction offset) -> site
        self.site_info: list[dict] = []
        self.modules: dict[int, tuple[weakref.ref, int]] = {}
        self.module_info: list[dict] = []
        self.param_names: dict[int, tuple[weakref.ref, str, str]] = {}  # id -> (ref, name, its module)
        self.opt_index: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
        self.sched_index: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
        self.scheds: list[tuple[weakref.ref, int]] = []
        self.scaler_index: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
        self.autocast_sites: dict[tuple, int] = {}
        self.sent_sites = 0
        self.sent_modules = 0
        self.events: list[dict] = []
        self.benign_sites: set[int] = set()  # sites that made non-finite values in healthy steps
        # id(parameter) -> (ref, version, min tensor or None for ±max, max tensor, measured at step,
        # exact for this version): carried across steps, refreshed by the optimizer post-hook
        self.param_stats: dict[int, tuple] = {}
        self.untrusted_opts: set[int] = set()  # optimizers that have seen a non-finite gradient
        self.names_cache: dict[tuple, tuple[list[str], list[str], int]] = {}
        self.opt_plans: dict[int, _OptPlan] = {}  # id(optimizer) -> its plan (see _plan_of)
        self.list_ids: dict[tuple, int] = {}  # (names, layers) -> id in param_lists
        self.param_lists: list[dict] = []  # lists of parameters named in step records, sent once
        self.sent_lists = 0
        self.origins = 0
        self.defer_cpu = True  # CPU calls are settled by the loss (see _defer)
        COLLECTORS.add(self)  # (off while a rehearsed memory history records: see hold_no_tensors)
        self.mstack: list[int] = []  # running modules, innermost last
        self.wstack: list[Any] = []  # for each: the user's line of its call if it is a library module
        self.lstack: list[bool] = []  # for each: whether its pre-hook took the mode off (a leaf)
        self.times_phases = False  # whether these hooks time the forward and optimizer phases
        self.fwd_t0 = self.opt_t0 = 0.0
        self.opt_frame: Any = None  # the frame that called the optimizer pre-hook, during the step
        self.opt_where: Any = None  # the user's line of that call, once found
        self.window: frozenset[int] = frozenset()  # the profiler's steps: never checked (see schedule)
        self.dense = DENSE_STEPS  # the dense start's end (schedule.dense_steps; set with the window)
        self.timed: frozenset[int] = frozenset()  # a short run's timed steps (schedule.timed_block; set with it)
        self.alarmed = False  # a non-finite value was seen: every later step is checked
        self.autocast_next: tuple[int, dict[int, int]] = (-1, {})  # (step, autocast site -> entries) carried to it
        self.spacing = Spacing()  # the checks' measured cost, and how far apart it puts them
        self.step_checked = True  # whether the running step is checked (see schedule)
        self.stepping = False  # a step runs, checked or not (its events are the step's)
        self.watching = False  # an unchecked step runs: its first loss is kept
        self.watch_off = False  # reading an unchecked step's loss failed once: no more watching
        self.watched: Any = None  # an unchecked step's first loss (a host loss's value), judged at its end
        # (step, host copy, event, whether the copy is the loss's value or its isfinite flag): a
        # GPU loss's read, once its event completes
        self.queued: list[tuple[int, Any, Any, bool]] = []
        self.module_hooks: list[Any] = []  # handles of the global module hooks (see install)
        self.light_ok = "light" not in OFF  # outermost calls outside checked steps: see _light_call
        self.light = OneCall()  # the light call's end
        self._reset_step()

    # --- lifecycle ------------------------------------------------------------------------------

    def install(self) -> None:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._hook_modules()
        register_optimizer_step_pre_hook(self._opt_pre)
        register_optimizer_step_post_hook(self._opt_post)
        probes.read_traced_steps(self._traced_step_ran)
        # (dynamo traces and guards the mode stack it finds)
        compiled_calls_without(self.mode, self._compiled_call_starts, self._compiled_call_ran)
        probes.read_backward_calls(self._backward_in_compiled_call)
        # these hooks run where the probes' phase hooks do: time the phases here, one hook less
        self.times_phases = probes.take_over_phase_timing()
        install_config_probes(self)
        install_amp_probes(self)
        install_backward_probe(self)

    def _hook_modules(self) -> None:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self.module_hooks = [register_module_forward_pre_hook(self._module_pre)]
        try:
            self.module_hooks.append(register_module_forward_hook(self._module_post, always_call=True))
        except TypeError:  # torch without always_call
            self.module_hooks.append(register_module_forward_hook(self._module_post))

    def step_begin(self, index: int) -> None:
        self.step = index
        now, sp = perf(), self.spacing
        if sp.ended(index, now, self.window, self.dense) and sp.not_before - sp.last[0] > CHECK_EVERY:
            self.events.append({"event": "checks-spaced", "step": sp.last[0], "cost_steps": round(sp.cost_steps, 3),
                                "not_before": sp.not_before, "budget": CHECKS_BUDGET})
        self.step_checked = _scheduled(index, self.window, self.alarmed, self.dense, sp.not_before, self.timed)
        if self.step_checked and index >= self.dense and not self.alarmed and off("checks", index):
            self.step_checked = False  # (bench_steady_parts.py only)
        sp.began(index, self.step_checked, now)
        self.stepping = True
        self.watched = None
        if off("hooks", index):  # (bench_steady_parts.py only: no module hooks in unchecked steps)
            if self.step_checked and not self.module_hooks:
                self._hook_modules()
            elif not self.step_checked and self.module_hooks:
                for h in self.module_hooks:
                    h.remove()
                self.module_hooks = []
        elif TOGGLED and not self.module_hooks:  # (a toggled bench's block with them back)
            self._hook_modules()
        if not self.step_checked:  # a timed or profiled step: nothing of the checks runs in it
            self.watching = index not in self.window and not off("watch", index)  # (nothing of ours in the trace: its loss unread)
            return
        dynamo_skips_our_frames()
        # (step_end left the state fresh: nothing writes it between steps, every writer asks
        # in_step first; after a step_end that failed before its reset, reset here)
        if not self.fresh:
            self._reset_step()
        self.fresh = False
        if self.autocast_next[0] == index:  # (regions entered after the last step's update: see amp_probes)
            self.autocast_used.update(self.autocast_next[1])
        self.in_step = True
        self.paused = 0
        self.mode_popped = 0
        self.in_backward = 0
        if self.checking:
            self.mode.__enter__()

    def step_end(self, index: int) -> dict[str, Any] | None:
        self.stepping = False
        if not self.step_checked:
            if self.watching:
                self.watching = False
                self._read_watched(index)
            return None
        try:
            if _top_mode() is self.mode:
                self.mode.__exit__(None, None, None)
            elif self.checking and not self.mode_popped:  # someone else's mode is on top: the user's
                self.failed(RuntimeError("torch function mode stack changed during the step"))
        except Exception as e:
            self.failed(e)
        self.mode_popped = 0
        self.in_step = False
        self.paused = 0
        self.opt_frame = None  # (an optimizer step that raised never reached the post-hook)
        in_step_s = self.check_s
        t0 = perf()
        try:
            with _checks_range():
                if self.deferred:  # calls after the last backward pass (or a step without one)
                    self.resolve_deferred()
                data = self._materialise(index)
        except Exception as e:
            self.failed(e)
            data = {"error": f"{type(e).__name__}: {e}"}
        self.check_s += perf() - t0
        data["check_ms"] = round(self.check_s * 1e3, 3)
        data["check_in_step_ms"] = round(in_step_s * 1e3, 3)  # (part of the step's wall time)
        data["events"], self.events = self.events, []
        data.update(self._new_tables())
        if self.error_text:
            data["collector_errors"] = self.errors
            data["collector_error"] = self.error_text
        if self._gone_wrong(data):
            self.alarmed = True
        self._reset_step()
        return data

    def _gone_wrong(self, data: dict[str, Any]) -> bool:
        """Whether a checked step's values went wrong, which turns the checks on for every later
        step: a non-finite loss, gradient or weight, or a non-finite output at a site not learned
        as making them by design (`benign_sites`: an attention mask's -inf, `log` of an exact 0
        under a guard, learned from the healthy steps that made them; `_materialise` has already
        learned this step's if it was healthy). By-design values alone never alarm the run, so
        the steps after the dense start are timed as in any run."""
        if data.get("loss_finite") is False:
            return True
        if any(r.get("grad_nonfinite") or r.get("param_nonfinite") for r in data.get("opt_steps") or ()):
            return True
        benign = self.benign_sites
        return any(s not in benign for s in data.get("nonfinite_sites") or ())

    def _read_watched(self, index: int) -> None:
        """An unchecked step's end (its time already taken): its loss, if non-finite, turns the
        checks on for every later step. A CPU loss is read now; a GPU one is reduced on the device
        and read once its event completes (queried, never waited for)."""
        loss, self.watched = self.watched, None
        try:
            with _no_torch_function():  # (no grad mode wanted: every read below makes a bool)
                if isinstance(loss, float):  # (a one-element host loss, read as its backward began)
                    if not (loss == loss and abs(loss) != math.inf):
                        self._alarm(index)
                elif loss is not None:
                    if loss.is_cpu:
                        # one element, as a loss is: its value read, one op (isfinite and all are
                        # several, each a cold path through torch at every step's end: ~70 us)
                        if loss.numel() == 1:
                            v = _TB.item(loss)
                            ok = v == v and abs(v) != math.inf
                        else:
                            ok = bool(torch.isfinite(loss).all())
                        if not ok:
                            self._alarm(index)
                    elif loss.is_cuda:
                        # one element, as a loss is: the value itself is copied and judged on the
                        # host (one copy, where isfinite is four kernels: ==, abs, !=, *); more:
                        # their isfinite reduced on the device, and the flag copied
                        one = loss.numel() == 1
                        host = (loss if one else torch.isfinite(loss).all()).to("cpu", non_blocking=True)
                        event = torch.cuda.Event()
                        event.record()
                        self.queued.append((index, host, event, one))
                while self.queued and self.queued[0][2].query():
                    step, host, _, one = self.queued.pop(0)
                    v = _TB.item(host)
                    if not ((v == v and abs(v) != math.inf) if one else v):
                        self._alarm(step)
        except Exception as e:  # our bug must never become the user's failure: watching stops
            self.queued.clear()
            self.watch_off = True
            self.failed(e)

    def _alarm(self, step: int) -> None:
        if not self.alarmed:
            self.alarmed = True
            self.events.append({"event": "unchecked-nonfinite-loss", "step": step})

    def finish(self) -> dict[str, Any] | None:
        return {"errors": self.errors, "error": self.error_text, "checking": self.checking,
                "events": self.events, **self._new_tables()}

    def failed(self, e: BaseException) -> None:
        self.errors += 1
        self.error_text = f"{type(e).__name__}: {e}"[:300]
        if self.errors >= MAX_ERRORS:
            self.checking = False

    def _reset_step(self) -> None:
        self.values = Values()
        self.ops: list[tuple] = []  # (site, module, in_refs, out_refs, hazard, half, kind, param ids)
        self.cache: dict[int, tuple[weakref.ref, int, int]] = {}  # id -> (ref, version, stat ref)
        self.sym_refs: set[int] = set()  # ranges that are ±max|w| rather than min..max
        self.stale_refs: dict[int, int] = {}  # weight ranges measured at an earlier step: ref -> step
        self.dropped = 0
        self.losses: list[int] = []
        self.backward = 0
        self.backward_site: int | None = None  # the site of the step's first backward call (`loss.backward()`)
        self.scaled_ids: set[int] = set()
        self.opt_steps: list[dict] = []
        self.autocast_used: dict[int, int] = {}
        self.scaler_updates: list[tuple[int, int | None, int]] = []
        self.scale_calls = 0
        self.check_s = 0.0
        # deferred calls: (ops slot, resolve, its arguments), None once settled (see _defer)
        self.deferred: list[tuple | None] = []
        self.pending: dict[int, list[int]] = {}  # id of a deferred output -> its calls in `deferred`
        self.deferred_bytes = 0
        self.aliases: dict[int, tuple[int, ...]] = {}  # id of `t.data` / `t.detach()` -> ids of t (and its base)
        # (first op, end, Function) of each run of a hand-written backward (see backward_probe)
        self.backward_fns: list[tuple[int, int, str]] = []
        self.fresh = True  # (see step_begin)

    # --- module hooks ---------------------------------------------------------------------------

    def _module_pre(self, module, args) -> None:
        if _compiling() or not self.module_hooks:  # (off: a call begun before step_begin took them out)
            return
        if not self.mstack:  # an outermost call: the forward phase starts
            self.fwd_t0 = perf()
            if (not self.in_step and self.light_ok and type(module).__name__ != "OptimizedModule"
                    and not _compiled_anything()):
                if not module._modules:
                    # a module without submodules (an RNN cell a loop calls at every time step) makes
                    # no module calls inside it for torch's fast path to speed up: the hooks as they
                    # are time it (_module_post), without the light call's changes to torch's dicts
                    self.mstack.append(-1)
                    self.wstack.append(None)
                    self.lstack.append(False)
                    return
                self._light_call(module)
                return
        where = None
        popped = False
        try:
            lib = _library_types.get(type(module))  # (the cache of _library_module, read inline: every module call)
            if lib is None:
                lib = _library_module(type(module))
            if lib and self.in_step and self.checking:
                where = self.wstack[-1] if self.wstack else None
                if where is None:
                    where = user_frame(sys._getframe(1))
                # A library leaf module (Linear, ReLU, a loss: no submodules) makes one known call:
                # its output is checked once, here, in the post-hook, with the mode off inside it.
                # That saves the mode's dispatch (~10-20 us a call) for most of a model's calls.
                n = _stack_len()  # (_top_mode, inline: every module call)
                if (where is not None and not module._modules and not self.paused
                        and n and _stack_at(n - 1) is self.mode):
                    _pop_mode()
                    popped = True
                    if self.pending and module.__dict__.get("inplace") and type(module) not in _LEAF_MONOTONE:
                        self._timed(self.resolve_written, args, {})  # (ReLU keeps non-finite values non-finite)
            entry = self.modules.get(id(module))  # (_module_id's first test, inline: every module call)
            self.mstack.append(entry[1] if entry is not None and entry[0]() is module else self._module_id(module))
        except Exception as e:
            self.mstack.append(-1)
            self.failed(e)
        self.wstack.append(where)
        self.lstack.append(popped)

    def _module_post(self, module, args, output) -> None:
        if self.mstack and not _compiling():
            if len(self.mstack) == 1 and self.times_phases:  # (timed before the checks below: they are the audit's time)
                where = self.wstack[-1]  # (a library module's line, found by the pre-hook)
                probes.forward_done(module, self.fwd_t0, where if where is not None else user_frame(sys._getframe(1)),
                                    output)
            if self.lstack and self.lstack.pop():
                t0 = perf()
                # (before the mode is back, and unseen by the modes below it, as in _Mode: our own
                # reductions are not the user's calls)
                with _no_torch_function():
                    try:
                        if _profiling():  # (tested inline, as in _Mode: every library layer call)
                            with torch.autograd.profiler.record_function(CHECKS_RANGE):
                                quietly(self._on_leaf, module, args, output)
                        else:  # (untraced: unseen.untraced)
                            quietly(self._on_leaf, module, args, output)
                    except Exception as e:  # our bug must never become the user's failure
                        self.failed(e)
                _push_mode(self.mode)
                self.check_s += perf() - t0
            self.mstack.pop()
            self.wstack.pop()

    def _light_call(self, module: torch.nn.Module) -> None:
        """An outermost module call outside the checked steps (a timed step, setup, between steps):
        only its time is wanted (the forward phase), so for its duration these hooks are taken out
        of torch's global hook dicts, and the calls inside it take torch's fast path (any global
        hook sends every module call through the slow one: ~0.8 ms a step of 120 tiny layers on
        this machine, 6%). The call's end (auditor.capture.one_call) puts them back where they were
        in torch's order. Not once torch.compile has compiled anything (its guards may read the
        global hooks: a change between the checked and the other steps would recompile)."""
        hp, hq = self.module_hooks
        out = ((_nn_module._global_forward_pre_hooks, hp.id, self._module_pre),
               (_nn_module._global_forward_hooks, hq.id, self._module_post))
        if not self.light.watch(module, self._light_end, out):  # a torch without always_call: the slow path for good
            self.light_ok = False
            self._module_pre(module, ())

    def _light_end(self, module, args, output) -> None:
        if self.times_phases:
            where, f = user_place(sys._getframe(1))
            probes.forward_done(module, self.fwd_t0, where, output, f)

    def _on_leaf(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        """Record a library leaf module's call as one op: its arguments and own parameters in,
        its output out, at the user's line of the module call. A call whose output is one CPU
        tensor (not float16) is deferred instead (see `_defer`)."""
        rec = probes.REC
        if rec is not None and rec.in_data:
            return
        if self.defer_cpu and type(output) is torch.Tensor and output.is_cpu and output.dtype is not _HALF:
            self._defer(self._leaf_record, (module, args, output, self.wstack[-1], self.mstack[-1]), (output,))
        else:
            self._leaf_record(None, module, args, output, self.wstack[-1], None)

    def _leaf_record(self, slot: int | None, module: torch.nn.Module, args: tuple, output: Any, where: Any,
                     mid: int | None) -> None:
        if type(output) in _PLAIN_TYPES:
            if not _checkable(output):
                return
            outs = [output]
        else:
            outs = _tensors_in(output)
            if not outs:
                return
        ins = _tensor_args(args)
        for p in module._parameters.values():
            if p is not None and _checkable(p):
                ins.append(p)
        cls = type(module)
        self._record(cls, PLAIN, (), ins, outs, _LEAF_MONOTONE.get(cls), where, mid, slot)

    # --- ops ------------------------------------------------------------------------------------

    def _stat(self, t: torch.Tensor) -> int:
        """Reference of the range of t (min at ref, max at ref + 1), cached per tensor version
        within the step. A parameter's range carries over between steps while its version stays:
        the optimizer post-hook records ±max|w| after each update (one `_foreach_norm` for all),
        so weights are not reduced again in the forward pass."""
        key = id(t)
        version = _version_of(t)
        cache = self.cache
        hit = cache.get(key)
        if hit is not None and hit[1] == version and hit[0]() is t:
            return hit[2]
        values = self.values
        carried = self.param_stats.get(key) if type(t) is torch.nn.Parameter else None
        if carried is not None and carried[1] == version and carried[0]() is t:
            lo, hi = carried[2], carried[3]
            vals = values.vals
            ref = len(vals)
            if not carried[5]:  # carried over a trusted update: the range of an earlier version
                self.stale_refs[ref] = carried[4]
            if type(lo) is float:  # a CPU weight: its host range (the common case, inlined)
                vals.append(lo)
                vals.append(hi)
            elif lo is None:  # symmetric: -max|w| .. max|w|
                ref = values.derive(ref + 1, _neg)
                values.add(hi)
                self.sym_refs.add(ref)
            else:
                ref = values.add_range(lo, hi)
            cache[key] = (carried[0], version, ref)  # (the weak reference is the parameter's own)
            return ref
        if t.is_cpu and t.dim() == 0 and type(t) is torch.Tensor and not t.dtype.is_complex:  # a loss: its value is its range
            v = _TB.item(t)
            vals = values.vals
            ref = len(vals)
            vals.append(v)
            vals.append(v)
            cache[key] = (weakref.ref(t), version, ref)
            return ref
        lo, hi = torch.aminmax(_real(_stored(t.detach())))
        ref = values.add_range(lo, hi)
        wr = weakref.ref(t)
        if type(t) is torch.nn.Parameter:
            if lo.is_cpu:  # keep the host values: later steps reuse them without an `item`
                lo, hi = values.vals[ref], values.vals[ref + 1]
            self.param_stats[key] = (wr, version, lo, hi, self.step, True)
        cache[key] = (wr, version, ref)
        return ref

    def _stat_in(self, t: torch.Tensor, outs: list[torch.Tensor]) -> int | None:
        """Stats of an input. An input the call modified in place (it is also an output) can only
        use the stats taken before the call; without them it has none."""
        if any(t is o for o in outs):
            hit = self.cache.get(id(t))
            return hit[2] if hit is not None and hit[0]() is t else None
        return self._stat(t)

    def on_op(self, func: Callable, kind: int, args: tuple, kwargs: dict, out: Any) -> None:
        rec = probes.REC
        if rec is not None and rec.in_data:
            return  # batch collation: data is judged where the step consumes it
        if type(out) in _PLAIN_TYPES:
            if not _checkable(out):
                return
            outs: list[torch.Tensor] = [out]
            host = out.is_cpu and out.dtype is not _HALF
        else:
            outs = _tensors_in(out)
            if not outs:
                return
            host = all(o.is_cpu and o.dtype is not _HALF for o in outs)
        # Every reduction below runs on t.detach(): no autograd graph, no grad mode switch needed.
        call_args = args if not kwargs else (*args, *kwargs.values())
        if host and kind == PLAIN and self.defer_cpu and not _mutates.get(func) and "out" not in kwargs:
            # a plain call (not a hazard: their statistic is wanted in healthy steps too), deferred
            # like a leaf module's; its site is found now, while its frames exist, and its tensor
            # arguments are taken as they are (which of them are checkable is asked only if the
            # call is ever reduced)
            site = self._site(func, 3, None)
            self._defer(self._resolve_op, (func, _tensor_refs(call_args), outs, site,
                                           self.mstack[-1] if self.mstack else -1), outs)
            return
        ins = _tensor_args(call_args)
        self._record(func, kind, args, ins, outs, _monotone(func, kind, ins))

    def _resolve_op(self, slot: int, func: Callable, refs: list, outs: list, site: int, mid: int,
                    kind: int = PLAIN) -> None:
        ins = [t for t in refs if _checkable(t)]  # (the test _tensor_args makes at once)
        self._record(func, kind, (), ins, outs, _monotone(func, kind, ins), None, mid, slot, site)

    def _compiled_call_starts(self, args: tuple, kwargs: dict) -> tuple | None:
        """Before a call of compiled code (see _compiled_call_ran): its tensor arguments and their
        versions. Compiled code may write into them, unseen: a deferred output among them is
        reduced first, while it is what the call that made it made (as before any write)."""
        if not (self.in_step and self.checking) or self.paused:
            return None
        rec = probes.REC
        if rec is not None and rec.in_data:
            return None
        refs = _tensor_refs(args if not kwargs else (*args, *kwargs.values()))
        if refs and (self.pending or self.aliases):
            self._timed(self.resolve_written, args, kwargs)
        if refs and not torch_private.compiled_writes_move_versions():
            self._timed(self._stats_of, refs)  # (its writes will not show: each argument is taken as written)
        return refs, [_version_of(t) for t in refs]

    def _stats_of(self, refs: list) -> None:
        for t in refs:
            if _checkable(t):
                self._stat(t)

    def _compiled_call_ran(self, compiled: Callable, args: tuple, kwargs: dict, out: Any, frame: Any,
                           started: tuple | None) -> None:
        """A call of compiled code, run with the mode off the stack (unseen.compiled_calls_without),
        checked as one call at the user's line that made it: its tensor arguments in, its result
        and the arguments it wrote into out, named `torch.compile(Net)` or `torch.compile(fn)`. A
        non-finite value made inside is then traced to this call, not taken for bad input data
        by the first checked call that receives it, nor blamed on the call that made a tensor
        the compiled code then overwrote. Deferred like a plain call on the CPU.
        On a torch whose compiled code writes into its arguments without moving their versions
        (torch_private.compiled_writes_move_versions), every argument is taken as written: as an
        output, its range as it was before the call (taken then) kept as the call's input and
        read as nothing else."""
        if started is None:
            return
        t0 = perf()
        refs, versions = started
        with _checks_range():
            try:
                outs = _tensors_in(out)
                unseen = not torch_private.compiled_writes_move_versions()
                outs += [t for t, v in zip(refs, versions)
                         if (unseen or _version_of(t) != v) and _checkable(t) and not any(t is o for o in outs)]
                if unseen:
                    cache = self.cache
                    for t in outs:
                        hit = cache.get(id(t))
                        if hit is not None and hit[0]() is t:
                            cache[id(t)] = (hit[0], _BEFORE_UNSEEN_WRITE, hit[2])
                        self.param_stats.pop(id(t), None)  # (a parameter's range carried over steps)
                if outs:
                    fn = getattr(compiled, "_torchdynamo_orig_callable", compiled)
                    owner = getattr(fn, "__self__", None)  # (a module's forward: its bound __call__)
                    if not isinstance(owner, torch.nn.Module):
                        owner = getattr(fn, "__wrapped__", None)  # (a torch module's: wrapped whole)
                    if isinstance(owner, torch.nn.Module):
                        op = f"torch.compile({type(owner).__name__})"
                        entry = self.modules.get(id(owner))  # (named by the hooks of its OptimizedModule)
                    else:
                        op = f"torch.compile({getattr(fn, '__qualname__', None) or getattr(fn, '__name__', '...')})"
                        entry = None
                    mid = entry[1] if entry is not None and entry[0]() is owner else self.mstack[-1] if self.mstack else -1
                    site = self._site_at(op, user_call(frame), None, frame)
                    if self.defer_cpu and all(o.is_cpu and o.dtype is not _HALF for o in outs):
                        self._defer(self._resolve_op, (op, refs, outs, site, mid, COMPILED), outs)
                    else:
                        self._resolve_op(None, op, refs, outs, site, mid, COMPILED)
            except Exception as e:  # our bug must never become the user's failure
                self.failed(e)
        self.check_s += perf() - t0

    def _record(self, op: Any, kind: int, args: tuple, ins: list[torch.Tensor], outs: list[torch.Tensor],
                monotone: Callable[[float], float] | None, where: Any = _FIND, module: int | None = None,
                slot: int | None = None, site: int | None = None) -> None:
        """Ranges of a call's inputs and outputs (and its hazard statistic), as one op record,
        at `where` (the user's line) if known, else found from the stack; a deferred call's
        record goes to its `slot` with the module that was running when it was made."""
        if slot is None and len(self.ops) >= MAX_OPS_PER_STEP:
            self.dropped += 1
            return
        stat = self._stat
        cache = self.cache
        if len(outs) == 1:
            o = outs[0]
            in_refs = tuple([stat(t) if t is not o else self._stat_in(t, outs) for t in ins])
            cache.pop(id(o), None)  # an in-place op: forget the stats of the value before the call
            if (monotone is not None and len(ins) == 1 and in_refs[0] is not None
                    and in_refs[0] not in self.sym_refs):
                values = self.values
                ref = values.derive(in_refs[0], monotone)
                values.derive(in_refs[0] + 1, monotone)
                cache[id(o)] = (weakref.ref(o), _version_of(o), ref)
                out_refs: tuple = (ref,)
            else:
                out_refs = (stat(o),)
            half = o.dtype == torch.float16
        else:
            in_refs = tuple([self._stat_in(t, outs) for t in ins])
            for t in outs:
                cache.pop(id(t), None)
            out_refs = tuple([stat(t) for t in outs])
            half = any(t.dtype == torch.float16 for t in outs)
        hazard = self._hazard_stat(kind, args, in_refs, out_refs) if kind != PLAIN else None
        label = HAZARD_NAMES.get(kind) or ("fp16" if half else None)
        if site is None:
            site = self._site(op, 4, label) if where is _FIND else self._site_at(op, where, label)
        # ids of the inputs (their base for views): a parameter among them is named if this call
        # turns out to be the origin (param_names holds weak references, so a reused id is no match)
        params = tuple([id(t._base if t._base is not None else t) for t in ins])
        if module is None:
            module = self.mstack[-1] if self.mstack else -1
        rec = (site, module, in_refs, out_refs, hazard, half, kind, params)
        if slot is None:
            self.ops.append(rec)
        else:
            self.ops[slot] = rec

    def _hazard_stat(self, kind: int, args: tuple, in_refs: tuple, out_refs: tuple) -> tuple | None:
        """(what, ref or constant): the one number that says how close this call is to its hazard."""
        if kind in (DIV, RDIV):
            den = args[1] if kind == DIV and len(args) > 1 else args[0] if args else None
            if isinstance(den, torch.Tensor) and _checkable(den):
                return ("min_abs_den", self.values.add(den.detach().abs().amin()))
            if isinstance(den, (int, float)) and den == 0:
                return ("min_abs_den_const", 0.0)
            return None
        if (not in_refs or in_refs[0] is None) and kind != NORM:
            return None
        if kind in (LOG, LOG1P, SQRT, POW) and args and isinstance(args[0], torch.Tensor) and args[0].dtype.is_complex:
            return None  # (defined on the whole complex plane but at 0; a range of parts says nothing here)
        if kind == POW:
            e = args[1] if len(args) > 1 else None
            if type(e) in (int, float) and (e >= 1 or e == 0):
                return None  # x**e for e >= 1 (x**2) has a finite value and derivative at 0: no hazard there
        if kind in (LOG, LOG1P, SQRT, POW):
            return ("min_in", in_refs[0])
        if kind == EXP:
            return ("max_in", in_refs[0] + 1)
        if kind == NORM and out_refs:
            return ("min_out", out_refs[0])
        return None

    def on_backward(self, args: tuple, kwargs: dict) -> None:
        self.backward += 1
        if self.backward_site is None:  # (where a non-finite gradient's backward pass started: once a step)
            self.backward_site = self._site_at("Tensor.backward", user_call(sys._getframe(1)))
        root = args[0] if args else kwargs.get("tensors", kwargs.get("outputs"))
        roots = [root] if isinstance(root, torch.Tensor) else list(root or ())
        grad_mode = torch.is_grad_enabled()
        try:
            _set_grad(False)  # (cheaper than torch.no_grad(), on every step)
            finite = seen = False
            vals = self.values.vals
            for t in roots:
                if not (isinstance(t, torch.Tensor) and _checkable(t)):
                    continue
                if id(t) not in self.scaled_ids:
                    ref = self._stat(t)
                    self.losses.append(ref)
                    lo, hi = vals[ref], vals[ref + 1]
                    ok = lo is not None and hi is not None and _finite(lo, hi)
                else:  # GradScaler's scaled loss: not the loss, but it says as much
                    ok = t.is_cpu and t.numel() == 1 and math.isfinite(_TB.item(t))
                finite = ok if not seen else finite and ok
                seen = True
            if self.deferred:
                self._settle(seen and finite)
        except Exception as e:
            self.failed(e)
        finally:
            _set_grad(grad_mode)

    def _keep_watched(self, root: torch.Tensor) -> None:
        """The loss an unchecked step's first backward pass starts from, kept for _read_watched: a
        one-element host loss as its value, read now (no wait on the host, and nothing held: a
        detached tensor and its read at the step's end cost ~3 us more, at every step); any other
        detached (not the loss itself: its graph is not held to the step's end)."""
        try:
            with _no_torch_function():  # (the auditor's reads: the user's modes see the user's calls only)
                if root.is_cpu and root.numel() == 1:
                    self.watched = _TB.item(root)
                    return
            self.watched = root.detach()
        except Exception as e:  # our bug must never become the user's failure: watching stops
            self.watch_off = True
            self.failed(e)

    def _backward_in_compiled_call(self, args: tuple, kwargs: dict) -> None:
        """(Also keeps an unchecked step's first loss: see _read_watched.) A backward pass the user's code starts inside a call of compiled code (a compiled
        function that calls `loss.backward()`, run as it is after dynamo's graph break there), where
        the mode is off the stack (unseen.compiled_calls_without) and cannot see it: its loss is
        checked here, as the mode checks it elsewhere."""
        if self.watching:
            if self.watched is None and not self.watch_off:
                root = args[0] if args else kwargs.get("tensors", kwargs.get("outputs"))
                if isinstance(root, torch.Tensor) and root.is_floating_point():
                    self._keep_watched(root)
            return
        if in_compiled_call() and self.in_step and self.checking and not self.paused and not self.in_backward:
            t0 = perf()
            with _checks_range():
                self.on_backward(args, kwargs)
            self.check_s += perf() - t0

