"""The optimizer watch: gradient norms, learning rates and the weights after each update.

Global optimizer step hooks record, per optimizer step, the gradient norms (one `_foreach_norm`),
parameter norms after the update and the learning rate of each param group. A step that runs
inside code torch.compile traced (`opt.step = torch.compile(opt.step)`, a compiled function that
calls it, `fullgraph=True` too) traces the hooks into its graph: there they only take the mode off
the stack and note the step, which is read when the auditor next runs (before what would change
its gradients or learning rate, or at the step's end: `_traced_step_ran`).

On the CPU, where reading a value costs no device sync, the weights are not re-measured after an
update that cannot have made them non-finite (built-in optimizer, finite lr, eps > 0, finite
moderate gradients); they are re-measured at least every PARAM_REFRESH steps.
"""
from __future__ import annotations

import math
import sys
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch

from auditor.capture import probes
from auditor.capture.probes.recorder import NOTED
from auditor.capture.frames import user_frame
from auditor.capture.numerics.stack import _checks_range, _compiling, _pop_mode, _push_mode, _set_grad, _top_mode, perf
from auditor.capture.numerics.tensors import _STRIDED, _checkable, _is_wrapped, _real, _stored
from auditor.capture.numerics.values import _TB, _plain, _scalar
from auditor.capture.unseen import no_torch_function as _no_torch_function, quietly

if TYPE_CHECKING:
    from auditor.capture.numerics.collector_api import Collector

PARAM_REFRESH = 8  # on the CPU, weights are re-measured at least this often after safe updates
TRUSTED_OPTIMIZERS = frozenset({"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad",
                                "Adadelta", "ASGD"})


class _OptPlan:
    """An optimizer's checkable parameters and what follows from them (see Numerics._plan_of)."""

    __slots__ = ("ref", "index", "key", "params", "half", "real", "cpu_plain_dtype", "trustable", "_names")

    def __init__(self, opt: Any, index: int, key: tuple, params: list[torch.Tensor]) -> None:
        self.ref = weakref.ref(opt)
        self.index = index  # the optimizer's id in the records
        self.key = key
        self.params = params
        dtypes = {p.dtype for p in params}
        cpu = all(p.is_cpu for p in params)
        self.half = torch.float16 in dtypes
        self.real = not any(d.is_complex for d in dtypes)
        # one CPU dtype the norm accumulates in as it is (float32 or float64): no dtype argument
        self.cpu_plain_dtype = cpu and len(dtypes) == 1 and dtypes <= {torch.float32, torch.float64}
        cls = type(opt)
        # an update that cannot make finite weights non-finite, given finite moderate gradients
        # and learning rates (see Numerics._update_keeps_finite); float16 weights never qualify:
        # eps=1e-8 is 0 in float16, and a zero second moment gives 0/0
        self.trustable = (cls.__name__ in TRUSTED_OPTIMIZERS and cls.__module__.startswith("torch.optim")
                          and cpu and not self.half)
        self._names: tuple | None = None

    def names(self, col: Collector) -> tuple[list[str], list[str], int]:
        if self._names is None:
            self._names = col._names_of(self.params)
        return self._names


class OptimizerWatch:
    """Mixin of Numerics: its optimizer step hooks and what they record."""

    def _opt_pre(self, opt, args, kwargs) -> tuple | None:
        if _compiling():
            self._traced_opt_pre(opt)
            return None
        changed = quietly(self._opt_begins, opt, args, kwargs)  # (the audit's own work: unseen.untraced)
        # (after the checks' own reads: they are probed as before)
        return probes.update_begins(opt, *(changed or (args, kwargs))) or changed

    def _opt_begins(self, opt, args, kwargs) -> tuple | None:
        if NOTED:  # (compiled steps before this one are read first: probes.settle_traced_steps)
            probes.settle_traced_steps()
        self.opt_t0 = perf()
        self.opt_frame, self.opt_where = sys._getframe(1), None  # (see _opt_user_line)
        # The update's own ops (hundreds per step) are judged through the parameters afterwards:
        # take the mode off the stack for the step rather than pass each of them through.
        self.paused += 1
        if self.in_step and _top_mode() is self.mode:
            _pop_mode()
            self.mode_popped += 1
        if not self.in_step or not self.checking:
            return None
        if self.deferred:  # (no backward pass settled them: the update must not change their inputs first)
            try:
                self._timed(self.resolve_deferred)
            except Exception as e:  # our bug must never become the user's failure
                self._clear_deferred()
                self.failed(e)
        # (args are step()'s own: the optimizer first)
        closure = kwargs["closure"] if "closure" in kwargs else args[1] if len(args) > 1 else None
        if callable(closure):
            # LBFGS (or any optimizer given a closure) runs the model inside step(): the closure
            # is checked like the rest of the step, and the gradients are read after its first
            # evaluation, as the update sees them. (An optimizer pre-hook may hand step() new
            # arguments; the closure computes what it did.)
            wrapped = self._checked_closure(opt, closure)
            if "closure" in kwargs:
                return args, {**kwargs, "closure": wrapped}
            return (args[0], wrapped, *args[2:]), kwargs
        self._record_grads(opt, self._opt_site_line())
        return None

    def _traced_opt_pre(self, opt) -> None:
        """`_opt_pre` as torch.compile traces it into a compiled optimizer step, where it may only
        do what dynamo can replay after the graph (see unseen.TracedCalls): the step is noted, to
        be read once the compiled code has run (`_traced_step_ran`), and the mode is taken off the
        stack for the update, as `_opt_pre` does. Dynamo traces a call through the modes on the
        stack: with ours there, the user's graph would be made of the calls our mode passes on, not
        of theirs (Adam's `lr / bias_correction1` traced as `bias_correction1.reciprocal() * lr`)."""
        probes.traced_optimizer_step(opt)
        self.paused += 1
        if _top_mode() is self.mode:
            _pop_mode()
            self.mode_popped += 1

    def _traced_opt_post(self) -> None:
        """`_opt_post` as torch.compile traces it: the mode back on the stack if the traced
        pre-hook took it off."""
        self.paused = max(0, self.paused - 1)
        if self.mode_popped:
            self.mode_popped -= 1
            _push_mode(self.mode)

    def _traced_step_ran(self, opt, where: Any) -> None:
        """An optimizer step that ran inside compiled code, called at the user's line `where`,
        read where the auditor runs next (probes.settle_traced_steps): before anything that would
        change its gradients or learning rates (the next optimizer step, zero_grad, a backward
        pass, a scheduler's step) or at the step's end. Its gradient norms and learning rates are
        then the ones the update used, unless the compiled code itself changed them, and the
        weights it updated are checked as after any step. The update is not timed: nothing of
        ours runs inside the graph."""
        if not (self.in_step and self.checking):
            return
        t0 = perf()
        with _no_torch_function():  # (our reads: unseen by the user's modes, and by ours)
            self._record_grads(opt, where)
            if self.opt_steps:
                self.opt_steps[-1]["compiled"] = True
            self._check_update(opt)
        self.check_s += perf() - t0

    def _record_grads(self, opt, where: Any) -> None:
        t0 = perf()
        grad_mode = torch.is_grad_enabled()
        try:
            _set_grad(False)  # (cheaper than torch.no_grad(), on every step)
            with _checks_range():
                self.opt_steps.append(self._grads(opt, where))
        except Exception as e:
            self.failed(e)
        finally:
            _set_grad(grad_mode)
        self.check_s += perf() - t0

    def _opt_site_line(self) -> Any:
        """Where an optimizer step's checks are reported: inside a library module's forward, that
        module's line (as `_site` does); otherwise the user's line of the call."""
        w = self.wstack[-1] if self.wstack else None
        return w if w is not None else self._opt_user_line()

    def _opt_user_line(self) -> Any:
        """The user's line of the running optimizer step, found once per step for its site and its
        phase tally (the walk up the stack starts from the frame that called the pre-hook)."""
        if self.opt_where is None and self.opt_frame is not None:
            self.opt_where = user_frame(self.opt_frame)
        return self.opt_where

    def _checked_closure(self, opt, closure: Callable) -> Callable:
        first = [True]

        def closure_checked():
            self.paused -= 1
            pushed = False
            if self.mode_popped and self.checking and _top_mode() is not self.mode:
                _push_mode(self.mode)
                pushed = True
            try:
                return closure()
            finally:
                if pushed and _top_mode() is self.mode:
                    _pop_mode()
                self.paused += 1
                if first[0] and self.in_step and self.checking:
                    first[0] = False
                    self._record_grads(opt, self._opt_site_line())

        return closure_checked

    def _opt_post(self, opt, args, kwargs) -> None:
        if _compiling():
            self._traced_opt_post()
            return
        quietly(self._opt_ends, opt)  # (the audit's own work: unseen.untraced)

    def _opt_ends(self, opt) -> None:
        probes.update_ends()
        if self.times_phases:
            probes.optimizer_done(opt, self.opt_t0, self._opt_user_line())
        self.opt_frame = None  # (a frame keeps its locals alive)
        t0 = perf()
        try:
            if self.opt_steps:  # (an unchecked step recorded none: nothing to check)
                self._check_update(opt)
        finally:
            self.paused = max(0, self.paused - 1)
            if self.mode_popped:
                self.mode_popped -= 1
                _push_mode(self.mode)
            self.check_s += perf() - t0

    def _check_update(self, opt) -> None:
        """The weights after `opt`'s update (recorded by `_record_grads` before it) are checked."""
        rec = self.opt_steps[-1] if self.opt_steps else None
        plan = rec.get("plan") if rec is not None else None
        if plan is None or plan.ref() is not opt:
            return
        grad_mode = torch.is_grad_enabled()
        try:
            if self.in_step and self.checking:
                _set_grad(False)
                params = plan.params
                with _checks_range():
                    if params and self._update_keeps_finite(opt, rec, params):
                        stats = self.param_stats
                        for p in params:  # same ranges, now valid for the updated version
                            e = stats[id(p)]
                            stats[id(p)] = (e[0], p._version, e[2], e[3], e[4], False)
                        rec["param_trusted"] = True
                    elif params:
                        rec["param_maxabs"] = self._param_maxabs(params)
                        rec["param_list"] = self._names_of(params)
        except Exception as e:
            self.failed(e)
        finally:
            # the record lives until the step's end: its plan would keep the optimizer's parameters
            # (and, through their gradients' owners, a model the program has dropped) alive with it
            rec.pop("plan", None)
            _set_grad(grad_mode)

    def _param_maxabs(self, params: list[torch.Tensor]) -> list[tuple[int, int | None]]:
        """The range of every parameter after the update: tells which weights stopped being
        finite, and serves the next forward pass as their input range (no second reduction).
        On CUDA one fused `_foreach_norm(inf)` (±max|w|); on the CPU, where that norm is ~20x slower
        than a reduction, one `aminmax` per parameter (exact min..max)."""
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for p in params:
            by_device.setdefault(p.device, []).append(p)
        refs = []
        for device, ps in by_device.items():
            if device.type == "cuda":
                dense = all(p.layout is _STRIDED for p in ps)
                ms = torch._foreach_norm(ps if dense else [_stored(p.detach()) for p in ps], math.inf)
                for p, mx in zip(ps, ms):
                    self.param_stats[id(p)] = (weakref.ref(p), p._version, None, mx, self.step, True)
                    refs.append((self.values.add(mx), None))
                continue
            for p in ps:
                lo, hi = torch.aminmax(_real(_stored(p.detach())))
                ref = self.values.add_range(lo, hi)
                if lo.is_cpu:  # host values: later steps reuse them without an `item`
                    lo, hi = self.values.vals[ref], self.values.vals[ref + 1]
                self.param_stats[id(p)] = (weakref.ref(p), p._version, lo, hi, self.step, True)
                refs.append((ref, ref + 1))
        return refs

    def _update_keeps_finite(self, opt, rec: dict, params: list[torch.Tensor]) -> bool:
        """On the CPU (where reading a value is no device sync) skip re-measuring the weights
        after an update that cannot have made them non-finite: a built-in optimizer, finite
        learning rates, eps > 0, finite and moderate gradients, never a non-finite gradient
        before, no float16 weights, and ranges measured within PARAM_REFRESH steps (the ranges
        then stay those of that step; an origin report says so). A step as large as the largest
        weight measured (or 1) is re-measured all the same: a diverging run's next origin report
        would show its weights as they were steps and orders of magnitude ago."""
        if not rec["plan"].trustable or rec["opt"] in self.untrusted_opts or "grad_norms_host" not in rec:
            return False
        max_lr = 0.0
        for g in opt.param_groups:
            lr, eps = g.get("lr"), g.get("eps", 1.0)
            if (not isinstance(lr, (int, float)) or not isinstance(eps, (int, float)) or not eps > 0
                    or not (math.isfinite(lr) and lr >= 0)):
                return False
            if lr > max_lr:
                max_lr = lr
        stats = self.param_stats
        oldest = self.step - PARAM_REFRESH
        scale = 1.0
        for p in params:
            e = stats.get(id(p))
            if e is None or e[4] <= oldest or e[0]() is not p:
                return False
            if -e[2] > scale or e[3] > scale:  # (host floats here: the CPU path)
                scale = max(-e[2], e[3])
        total = sum(rec["grad_norms_host"])  # (norms are >= 0: NaN or inf if any of them is)
        if not math.isfinite(total):
            if not all(map(math.isfinite, rec["grad_norms_host"])):
                self.untrusted_opts.add(rec["opt"])
            return False
        return total * max_lr <= scale  # (the sum bounds the largest norm, and an SGD step's size)

    def _norms(self, tensors: list[torch.Tensor]) -> int:
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for t in tensors:
            by_device.setdefault(t.device, []).append(t)
        # accumulated in float32 at least (a float16 norm overflows at 65504), float64 if any
        # gradient is float64 (the norm refuses to narrow it)
        dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
        if len(by_device) == 1 and tensors[0].is_cpu:  # read at once: no stack, no transfer
            norms = [_TB.item(n) for n in torch._foreach_norm(tensors, 2, dtype=dtype)]
            return self.values.add_host(_finite_norms(tensors, norms))
        parts = [torch.stack(torch._foreach_norm(ts, 2, dtype=dtype)) for ts in by_device.values()]
        return self.values.add(parts[0] if len(parts) == 1 else torch.cat([p.cpu() for p in parts]))

    def _grads(self, opt, where: Any) -> dict[str, Any]:
        plan = self._plan_of(opt)
        idx = plan.index
        lrs = []
        for g in opt.param_groups:
            lr = g.get("lr")
            # (a tensor lr is cloned: a scheduler may update it in place before the step's end)
            lrs.append(("ref", self.values.add(lr.detach().reshape(()).clone())) if isinstance(lr, torch.Tensor)
                       else lr)
        params = plan.params
        real = plan.real
        grads, owners = [], []
        for p in params:
            grad = p.grad
            # (the parameter is checkable, so its gradient is a floating tensor with data, and
            # torch keeps a gradient's dtype and device those of its parameter; the common case,
            # a dense real gradient, is settled by the first two tests)
            if grad is not None and type(grad) is torch.Tensor and not _is_wrapped(grad):
                if grad.layout is not _STRIDED:
                    if not grad.is_sparse:
                        continue
                    grad = grad.coalesce()._values()  # (Embedding(sparse=True)): its values hold its norm
                if not real:
                    grad = _real(grad)  # (the norm of its parts is the norm of a complex gradient)
                grads.append(grad)
                owners.append(p)
        scheds = {str(i): s.last_epoch for s, i in self._scheds_of(opt)} if self.scheds else {}
        rec: dict[str, Any] = {"opt": idx, "site": self._site_at("optimizer.step", where), "lrs": lrs, "plan": plan,
                               "sched_epochs": scheds}
        if grads:
            if plan.half:  # float16 weights updated from float16 gradients (amp-unscaled)
                rec["fp16_grads"] = sum(1 for t in grads if t.dtype == torch.float16)
            if plan.cpu_plain_dtype:  # the common case: read at once, no dtype argument (it costs ~5%)
                norms = [_TB.item(n) for n in torch._foreach_norm(grads, 2)]
                rec["grad_norms"] = self.values.add_host(_finite_norms(grads, norms))
            else:
                rec["grad_norms"] = self._norms(grads)
            host = self.values.vals[rec["grad_norms"]]
            if host is not None:  # already read (CPU): the post-hook may use it
                rec["grad_norms_host"] = host
            rec["grad_list"] = plan.names(self) if len(owners) == len(params) else self._names_of(owners)
        elif params and all(p.grad is None for p in params):
            rec["no_grads"] = True  # (the update skips every parameter: zero-gradients)
        return rec

    def _plan_of(self, opt) -> "_OptPlan":
        """What the optimizer hooks need to know of an optimizer, kept while its param groups
        stay the same lists with the same lengths (working it out in each hook of every step costs
        ~0.1 ms of Python a step)."""
        groups = opt.param_groups
        key = tuple([(id(g["params"]), len(g["params"])) for g in groups])
        plan = self.opt_plans.get(id(opt))
        if plan is not None and plan.key == key and plan.ref() is opt:
            return plan
        idx = self.opt_index.get(opt)
        if idx is None:
            idx = self._register_optimizer(opt, None)
        if plan is None:  # a plan holds its optimizer's parameters: it goes when the optimizer does
            weakref.finalize(opt, self.opt_plans.pop, id(opt), None)
        plan = self.opt_plans[id(opt)] = _OptPlan(opt, idx, key, [p for g in groups for p in g["params"] if _checkable(p)])
        return plan

    def _names_of(self, params: list[torch.Tensor]) -> tuple[list[str], list[str], int]:
        """Names and owning modules of a list of parameters, and the id of that list in the
        `param_lists` table (sent once: a step's record refers to it), cached while the list is
        the same."""
        key = tuple(map(id, params))
        hit = self.names_cache.get(key)
        if hit is None:
            names = params_names(self, params)
            layers = [self.param_layer(p) or n.rpartition(".")[0] or n for p, n in zip(params, names)]
            if len(self.names_cache) > 64:
                self.names_cache.clear()
            lid = self.list_ids.get((tuple(names), tuple(layers)))
            if lid is None:
                lid = self.list_ids[(tuple(names), tuple(layers))] = len(self.param_lists)
                self.param_lists.append({"names": names, "layers": layers})
            hit = self.names_cache[key] = (names, layers, lid)
        return hit

    def _scheds_of(self, opt) -> list[tuple[Any, int]]:
        out = []
        for ref, i in self.scheds:
            s = ref()
            if s is not None and getattr(s, "optimizer", None) is opt:
                out.append((s, i))
        return out

    def _register_optimizer(self, opt, where) -> int:
        idx = len(self.opt_index)
        self.opt_index[opt] = idx
        defaults = getattr(opt, "defaults", {}) or {}
        self.event("optimizer", where, opt=idx, type=type(opt).__name__,
                   lr=_scalar(defaults.get("lr")), defaults=_plain(defaults),
                   group_lrs=[_scalar(g.get("lr")) for g in opt.param_groups],
                   params=sum(len(g["params"]) for g in opt.param_groups))
        return idx


def _finite_norms(tensors: list[torch.Tensor], norms: list[float]) -> list[float]:
    """The norms, with each that is not finite taken again in float64. A float32 norm is inf as
    soon as the sum of squares passes 3.4e38 (a norm of 1.8e19), though every element is finite:
    a diverging run's gradient gets there steps before any value in it does, and is not reported
    as non-finite before one is. A NaN or inf element keeps the norm non-finite in float64 too. (The
    CPU path only: on CUDA the norms are read at the step's end, without a sync before.)"""
    if math.isfinite(sum(norms)):  # (the common case: one sum in C; float32 norms cannot overflow it)
        return norms
    return [n if math.isfinite(n) else _TB.item(torch.linalg.vector_norm(t, dtype=torch.float64))
            for t, n in zip(tensors, norms)]


def params_names(col: Collector, params: list[torch.Tensor]) -> list[str]:
    return [col.param_name(p) or f"param{i}{list(p.shape)}" for i, p in enumerate(params)]
