"""The numerics collector: where values stop being finite, gradient norms, learning rates, AMP.

Why it exists: a NaN is found long after it was made. Re-running a step to look for it is not an
option (steps have side effects, and after the first NaN the weights are poisoned), so everything
the rules need is recorded while the steps run, cheaply enough to stay on for the whole audit:

* A TorchFunctionMode, pushed only while the user's step runs, sees every torch call made from
  Python (the outermost one: `F.linear` inside `nn.Linear`, not the kernels below it). For each
  call with a floating-point result it records `aminmax` of the result (and of inputs no earlier
  call produced: parameters, data) as device tensors, plus the op, the user's line (frames.py) and
  the innermost module running. Nothing is read on the host per op: all values are stacked and read
  back once, at the end of the step (one device sync per step on CUDA).
* Global module pre/post forward hooks keep the stack of running modules, by qualified name. A
  library leaf module (nn.Linear, nn.ReLU, a loss: no submodules) is checked as one op by these
  hooks instead: the pre-hook takes the mode off for its forward, the post-hook records its
  arguments and own parameters in and its output out, at the user's line of the module call. Most
  of a model's calls happen inside such modules, and the mode's dispatch (~10-20 us a call on a
  busy step) is the largest fixed cost of checking one.
* A CPU leaf call (one output tensor, not float16), and a plain call the mode sees (not one of the
  hazard kinds, whose statistic is wanted in healthy steps too, and not one that writes into its
  arguments), is deferred: its tensors are kept, not reduced, and its place in the step's op order
  is held (a call's site is found at once, while its frames exist). When a backward pass starts,
  the loss it starts from settles them: finite, and every deferred call is taken as checked and
  let go (a non-finite value made on the way would have reached the loss, NaN and Inf propagate;
  one masked off before it did is what eager checks call benign); not finite, and each is reduced
  then, before the backward pass or the update changes anything, so the origin is found as if
  they had been checked at once. (The one case this misjudges: a value made before a backward
  pass, used only by a later loss of the same step; a NaN in it is then traced to the first call
  that used it after that backward pass.) A call about to write into a deferred output
  (`out += x`, `x[i] = v`, an in-place leaf, a write into a deferred view's base) has that output
  reduced first; the optimizer pre-hook and the step's end reduce whatever is still deferred
  (steps with no backward pass, calls after the last one); and past DEFER_MAX_BYTES of kept
  outputs they are reduced at once, so the memory they hold stays bounded. The first LEARN_STEPS
  healthy steps and every LEARN_EVERY-th are reduced in full anyway: a site that makes non-finite
  values by design (an attention mask's -inf) is learned as benign there, as eager checks learn
  it. On a healthy step most reductions, and nearly all of their Python, never happen. (Only on
  the CPU: on a GPU the kept outputs would be device memory, and there the checks are
  asynchronous kernels anyway.)
* The backward pass runs in C++, unseen, but for the hand-written backward of a user's
  `torch.autograd.Function`, which torch calls back in Python: the mode is pushed again for it
  (see `_install_backward_probe`), so a division by 0 there is named at its line, not blamed on
  a call of the forward pass.
* A call of code torch.compile compiled (`torch.compile(model)`, `@torch.compile`) runs with the
  mode off the stack: dynamo traces the modes it finds into the user's graph and guards on them
  (see unseen.compiled_calls_without). It is checked as one call, at the user's line
  (`_compiled_call_ran`: a NaN made inside is named there, `torch.compile(Net)`; a deferred
  output passed to it is reduced before, as it may write into it), and a backward pass it runs
  has its loss checked by the backward probe instead of the mode (`_backward_in_compiled_call`).
  What runs inside, eagerly or not, is not checked call by call.
* Global optimizer step hooks record, per optimizer step, the gradient norms (one `_foreach_norm`),
  parameter norms after the update and the learning rate of each param group. A step that runs
  inside code torch.compile traced (`opt.step = torch.compile(opt.step)`, a compiled function
  that calls it, `fullgraph=True` too) traces the hooks into its graph: there they only take the
  mode off the stack and note the step, which is read when the auditor next runs (before what
  would change its gradients or learning rate, or at the step's end: `_traced_step_ran`).
* The module and optimizer hooks also time the forward and optimizer phases for the probes, whose
  own hooks at the same points are taken out (`probes.take_over_phase_timing`): each global hook
  costs a Python call and torch's hook loop at every module call.
* Probes on Optimizer/LRScheduler construction and `load_state_dict`, GradScaler and autocast
  record the configuration the rules compare with what the run really did.

Every check runs under `torch.no_grad()` on tensors the user already made, and only reads them:
the user's computation, its RNG and its autograd graph are untouched. Checking code that fails is
switched off (counted in `errors`), never allowed to fail the step.

Cost (bench/bench_numerics.py, bench/bench_leaves.py): per checked call one `aminmax` of its result
(none for relu, sigmoid and tanh, whose range follows from their input's) plus ~10-20 us of Python
and the mode's own dispatch, ~20 us per deferred CPU leaf call; per optimizer step one
`_foreach_norm` of the gradients and one range per parameter after the update. On the CPU, where
reading a value costs no device sync, values are read as they are made (one `item` each) instead
of batched, and the weights are not re-measured after an update that cannot have made them
non-finite (built-in optimizer, finite lr, eps > 0, finite moderate gradients); they are
re-measured at least every PARAM_REFRESH steps. Calls inside a library module (Linear inside
Sequential) take the user's line found once by the module pre-hook instead of walking the stack
per call. Calls inside code torch.compile compiled, batch loading, `zero_grad` and the
optimizer's own update are not checked one by one.

Per step, `StepRecord.extra["numerics"]` holds (non-finite floats are the strings "nan", "inf",
"-inf", since JSON has no NaN):
    ops, nonfinite_ops, nonfinite_sites, dropped, check_ms (the checks' own time: in the step and
    in this record), check_in_step_ms (the part inside the step's wall time), loss, loss_finite, losses, backward,
    opt_steps[{opt, site, lrs, sched_epochs, grad_norm, grad_norms (one per parameter), grads (their
    names: an id in param_lists), grad_nonfinite, params_checked, param_max_abs, param_nonfinite,
    compiled (a step that ran in compiled code)}],
    hazards[[site, value]], autocast[[site, n]], scaler_updates[{scaler, before, after}],
    scaler_scale_calls, events[], sites{}, modules{}, param_lists{} (tables: new entries only),
    origin (only in the first few steps where the loss, a gradient or a parameter is non-finite).
The reader (auditor.rules.nonfinite.NumericsView) adds top_params and top_layers to opt_steps.
A hazard value is per site kind: log/sqrt/pow the smallest input, div the smallest |denominator|,
exp the largest input, norm the smallest norm, fp16 the largest |value|.
"""
from __future__ import annotations

import contextlib
import functools
import math
import sys
import time
import weakref
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from auditor.capture import probes
from auditor.capture.frames import call_span, code_kinds, is_library, library_code, user_call, user_frame
from auditor.capture.unseen import (compiled_calls_without, dynamo_skips_our_frames, in_compiled_call,
                                    no_torch_function as _no_torch_function)

perf = time.perf_counter

MAX_OPS_PER_STEP = 20000  # records kept per step; later calls are counted as dropped
MAX_ORIGINS = 3  # steps for which the origin of non-finite values is worked out and sent
MAX_HAZARD_SITES = 64
MAX_ERRORS = 20  # after this many failures of our own checking code, op checking switches off
FP16_MAX = 65504.0

LEARN_STEPS, LEARN_EVERY = 3, 16  # healthy steps whose deferred calls are reduced anyway (see _settle)
DEFER_MAX_BYTES = 64 << 20  # deferred outputs kept at most (beyond it they are reduced at once)
PARAM_REFRESH = 8  # on the CPU, weights are re-measured at least this often after safe updates
TRUSTED_OPTIMIZERS = frozenset({"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad",
                                "Adadelta", "ASGD"})
# What kind of call an op is. Hazard kinds get one extra statistic per call (see _hazard_stat).
SKIP, PLAIN, BACKWARD, LOG, LOG1P, DIV, RDIV, EXP, SQRT, POW, NORM, SETITEM, ALIAS, COMPILED = range(14)
HAZARD_NAMES = {LOG: "log", LOG1P: "log1p", DIV: "div", RDIV: "div", EXP: "exp", SQRT: "sqrt",
                POW: "pow", NORM: "norm"}

# Calls that cannot create a non-finite value or that only read metadata: passed straight through.
# empty* are skipped because uninitialised memory may hold NaN bit patterns the user overwrites.
_SKIP_NAMES = frozenset("""
__get__ __set__ __delete__ size dim ndimension numel nelement stride storage_offset data_ptr
is_contiguous is_floating_point is_complex element_size __len__ __iter__ __hash__ __repr__ __str__
__format__ __bool__ __int__ __float__ __index__ __contains__ __reduce_ex__ __deepcopy__ __setstate__
__getstate__ item tolist numpy view view_as reshape reshape_as flatten unflatten squeeze unsqueeze
permute transpose t expand expand_as contiguous detach detach_ requires_grad_ retain_grad
register_hook __getitem__ narrow select split split_with_sizes chunk unbind movedim
moveaxis swapaxes swapdims clone empty empty_like new_empty empty_strided new_empty_strided
pin_memory share_memory_ untyped_storage storage type_as_ as_strided unfold _make_subclass
get_device is_pinned is_shared is_set_to data dtype device shape
_record_function_enter _record_function_enter_new _record_function_exit
""".split())
_KIND_BY_NAME = {
    "backward": BACKWARD, "grad": BACKWARD, "__setitem__": SETITEM,
    "log": LOG, "log_": LOG, "log2": LOG, "log2_": LOG, "log10": LOG, "log10_": LOG,
    "log1p": LOG1P, "log1p_": LOG1P,
    "div": DIV, "div_": DIV, "divide": DIV, "true_divide": DIV, "__truediv__": DIV, "__itruediv__": DIV,
    "__div__": DIV, "__idiv__": DIV,
    "__rdiv__": RDIV, "__rtruediv__": RDIV, "reciprocal": RDIV, "reciprocal_": RDIV, "rsqrt": RDIV,
    "rsqrt_": RDIV,
    "exp": EXP, "exp_": EXP, "exp2": EXP, "exp2_": EXP, "expm1": EXP, "expm1_": EXP, "cosh": EXP,
    "sinh": EXP,
    "sqrt": SQRT, "sqrt_": SQRT,
    "pow": POW, "pow_": POW, "__pow__": POW, "__ipow__": POW, "float_power": POW,
    "norm": NORM, "linalg_vector_norm": NORM, "linalg_norm": NORM, "vector_norm": NORM,
}
_MODULE_DISPLAY = {"torch._C._nn": "torch.nn.functional", "torch._C._linalg": "torch.linalg",
                   "torch._C._special": "torch.special", "torch._C._fft": "torch.fft"}
_INPLACE_DUNDERS = frozenset("""__iadd__ __isub__ __imul__ __itruediv__ __idiv__ __ifloordiv__ __imod__
__ipow__ __imatmul__ __iand__ __ior__ __ixor__ __ilshift__ __irshift__""".split())
# A new tensor object over the same memory, neither a view (`_base`) nor always sharing the version
# counter (`.data` does not): a write through it must still reduce a deferred output first.
_kinds: dict[Any, int] = {torch.Tensor.data.__get__: ALIAS, torch.Tensor.detach: ALIAS, torch.detach: ALIAS}
_mutates: dict[Any, bool] = {}  # calls that write into their first argument (add_, __iadd__)
_library_types: dict[type, bool] = {}


def _library_module(cls: type) -> bool:
    """A module class defined in torch or another installed package (nn.Linear), not the user's."""
    v = _library_types.get(cls)
    if v is None:
        file = getattr(sys.modules.get(cls.__module__), "__file__", None)
        v = _library_types[cls] = bool(file) and is_library(file)
    return v


def _classify(func: Callable) -> int:
    name = getattr(func, "__name__", "")
    kind = SKIP if name in _SKIP_NAMES else _KIND_BY_NAME.get(name, PLAIN)
    try:
        _kinds[func] = kind
        _mutates[func] = (name.endswith("_") and not name.startswith("__")) or name in _INPLACE_DUNDERS
    except TypeError:  # an unhashable callable: classify it again next time
        pass
    return kind


@functools.lru_cache(maxsize=4096)
def _op_name(func: Callable) -> str:
    """A readable name: torch.log, Tensor.div, torch.nn.functional.linear."""
    name = getattr(func, "__name__", repr(func))
    qual = getattr(func, "__qualname__", name)
    owner = qual.rpartition(".")[0]
    if owner in ("TensorBase", "Tensor"):
        return f"Tensor.{name}"
    if owner == "_VariableFunctionsClass":
        return f"torch.{name}"
    module = getattr(func, "__module__", None) or "torch"
    module = _MODULE_DISPLAY.get(module, module)
    if module == "torch.linalg" and name.startswith("linalg_"):
        name = name[len("linalg_"):]
    return f"{module}.{name}"


def num(x: float | None) -> float | str | None:
    """A float for JSON: non-finite values as "nan", "inf", "-inf" (JSON has no NaN)."""
    if x is None or math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _finite(lo: float, hi: float) -> bool:
    return math.isfinite(lo) and math.isfinite(hi)


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided
CHECKS_RANGE = "auditor::numerics"  # the profiler range the checks' own ops run in
_profiling = torch._C._autograd._profiler_enabled
_NO_RANGE = contextlib.nullcontext()


class _Unseen:
    """The checks' own torch calls (aminmax, the gradient norms, item) run with torch-function
    dispatch off: a TorchFunctionMode of the user's (an op counter, a tracer) or a tensor subclass's
    `__torch_function__` must not see them (a counting mode saw 184 calls a step for the plain
    run's 180), and a mode passing them on made them look like the user's syncs. While the profiler
    records, they also run inside an `auditor::numerics` range: the report's operator table leaves
    them out as the audit's cost. (A `with` adds no frame: the checks' fixed stack depths hold.)"""

    __slots__ = ("off", "range")

    def __enter__(self) -> None:
        self.off = _no_torch_function()
        self.off.__enter__()
        self.range = torch.autograd.profiler.record_function(CHECKS_RANGE) if _profiling() else _NO_RANGE
        self.range.__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            self.range.__exit__(*exc)
        finally:
            self.off.__exit__(*exc)


def _checks_range() -> Any:
    """The context the checks run in (see _Unseen)."""
    return _Unseen()


def _set_grad(enabled: bool) -> None:
    """Grad mode on or off for the checks (cheaper than torch.no_grad(), on every step), unseen by
    the user's torch-function modes, like the checks themselves."""
    with _no_torch_function():
        torch._C._set_grad_enabled(enabled)


_compiling = torch.compiler.is_compiling  # code traced by torch.compile is not checked (or changed)
# torch.overrides' mode-stack helpers without their Python frame (the module hooks call two per module call)
_pop_mode = torch._C._pop_torch_function_stack
_push_mode = torch._C._push_on_torch_function_stack
_stack_len = torch._C._len_torch_function_stack
_stack_at = torch._C._get_function_stack_at


def _top_mode() -> Any:
    n = _stack_len()
    return _stack_at(n - 1) if n > 0 else None


def _checkable(t: Any) -> bool:
    """A plain (or Parameter) floating or complex tensor with data (a complex one is measured
    through its real and imaginary parts, see `_real`): subclasses (DTensor, fake/functorch
    tensors) are left alone, since reducing them could run collectives or escape a transform."""
    return (type(t) in _PLAIN_TYPES and (t.dtype.is_floating_point or t.dtype.is_complex) and not t.is_meta
            and t.numel() > 0 and not _is_wrapped(t))


try:
    _is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
except AttributeError:  # pragma: no cover - older torch
    def _is_wrapped(t: Any) -> bool:
        return False


def _real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as the floats it holds (real and imaginary parts): its range, and whether
    all are finite; a real tensor as it is."""
    return torch.view_as_real(t) if t.dtype.is_complex else t


def _version_of(t: torch.Tensor) -> int:
    """The tensor's version counter; -1 for inference tensors (torch.inference_mode), which have none."""
    try:
        return t._version
    except RuntimeError:
        return -1


def _tensor_args(args: Any) -> list[torch.Tensor]:
    """The checkable tensors among a call's arguments, and in its tuple/list arguments (torch.cat)."""
    return [t for t in _tensor_refs(args) if _checkable(t)]


def _tensor_refs(args: Any) -> list[torch.Tensor]:
    """The plain tensors among a call's arguments (and in its tuple/list arguments), checkable or
    not: `_tensor_args` without the per-tensor test, for a deferred call that may never need it
    (the lists are copied: the user may empty them after the call)."""
    refs: list[torch.Tensor] = []
    for a in args:
        if type(a) in _PLAIN_TYPES:
            refs.append(a)
        elif isinstance(a, (tuple, list)) and a and isinstance(a[0], torch.Tensor):
            refs.extend([t for t in a if type(t) in _PLAIN_TYPES])
    return refs


def _monotone(func: Callable, kind: int, ins: list[torch.Tensor]) -> Callable[[float], float] | None:
    """The scalar function a one-input monotone call (relu, exp, ...) applies, else None: its
    output range is then derived from its input's, without a reduction."""
    return _MONOTONE.get(getattr(func, "__name__", "")) if kind == PLAIN and len(ins) == 1 else None


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    """Floating tensors in a call's result or arguments (one level of tuples/lists)."""
    if isinstance(obj, torch.Tensor):
        return [obj] if _checkable(obj) else []
    if isinstance(obj, (tuple, list)):
        return [t for t in obj if isinstance(t, torch.Tensor) and _checkable(t)]
    return []


class Values:
    """Values recorded during a step, by reference, for the host to read at its end.

    `add` returns a reference (an index into `vals`). A CPU tensor is read at once (reading costs
    no device sync there, and one `item` is cheaper than batching); a device tensor is kept and
    read back with the others of its device at the end of the step: one transfer per device, so
    checks cost no host sync while the step runs. `derive` adds a value computed on the host from
    an earlier one (the range of relu(x) from the range of x), which costs no device work at all."""

    def __init__(self) -> None:
        self.vals: list[Any] = []  # host values by reference; None until read for device tensors
        self.pending: dict[tuple, tuple[list, list]] = {}  # (device, dtype, vector) -> (tensors, refs)
        self.derived: list[tuple[int, int, Callable[[float], float]]] = []

    def __len__(self) -> int:
        return len(self.vals)

    def add(self, t: torch.Tensor) -> int:
        vals = self.vals
        ref = len(vals)
        if t.is_cpu:
            vals.append(_TB.item(t) if t.dim() == 0 else _TB.tolist(t.double()))
            return ref
        vals.append(None)
        key = (t.device, t.dtype, t.dim() > 0)
        g = self.pending.get(key)
        if g is None:
            g = self.pending[key] = ([], [])
        g[0].append(t)
        g[1].append(ref)
        return ref

    def add_range(self, lo: torch.Tensor | float, hi: torch.Tensor | float) -> int:
        """min at the returned reference, max at the next. Host floats (a CPU weight's range kept
        from an earlier step) are stored as they are."""
        if type(lo) is float:
            vals = self.vals
            ref = len(vals)
            vals.append(lo)
            vals.append(hi)
            return ref
        if lo.is_cpu:
            vals = self.vals
            ref = len(vals)
            vals.append(_TB.item(lo))
            vals.append(_TB.item(hi))
            return ref
        ref = self.add(lo)
        self.add(hi)
        return ref

    def add_host(self, value: Any) -> int:
        """A value already on the host."""
        self.vals.append(value)
        return len(self.vals) - 1

    def derive(self, source: int, fn: Callable[[float], float]) -> int:
        """A value computed at read time as fn(value of `source`)."""
        ref = len(self.vals)
        self.vals.append(None)
        self.derived.append((ref, source, fn))
        return ref

    def read(self) -> list[Any]:
        vals = self.vals
        by_device: dict[torch.device, list[tuple]] = {}
        for key, (tensors, refs) in self.pending.items():
            by_device.setdefault(key[0], []).append((key, tensors, refs))
        for device, groups in by_device.items():
            wide = torch.float32 if device.type == "mps" else torch.float64
            parts = [_TB.to(torch.cat([t.reshape(-1) for t in ts]) if key[2] else torch.stack(ts), wide)
                     for key, ts, _ in groups]
            # one transfer per device; TensorBase's own tolist: the probes' sync wrappers on Tensor
            # are for the user's calls
            flat = _TB.tolist(torch.cat(parts) if len(parts) > 1 else parts[0])
            off = 0
            for (key, ts, refs), part in zip(groups, parts):
                if key[2]:
                    for t, ref in zip(ts, refs):
                        n = t.numel()
                        vals[ref] = flat[off:off + n]
                        off += n
                else:
                    for ref in refs:
                        vals[ref] = flat[off]
                        off += 1
        self.pending = {}
        for ref, source, fn in self.derived:  # in order: a derived value may build on an earlier one
            vals[ref] = fn(vals[source])
        self.derived = []
        return vals


_TB = torch._C.TensorBase


def _neg(x: float) -> float:
    return -x


def _relu(x: float) -> float:
    return x if math.isnan(x) else max(x, 0.0)


def _sigmoid(x: float) -> float:
    if math.isnan(x):
        return x
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def _tanh(x: float) -> float:
    return math.tanh(x)


# Elementwise monotone ops of one tensor: the output's range is f(input's range), derived on the
# host instead of reduced again on the device.
_MONOTONE = {"relu": _relu, "relu_": _relu, "sigmoid": _sigmoid, "sigmoid_": _sigmoid, "tanh": _tanh,
             "tanh_": _tanh}
_FIND = object()  # _record: find the user's line from the stack
_PENDING = None  # an `ops` slot held for a deferred call (see Numerics._defer)
_VERIFIED = ()  # ... that the loss showed finite, without a reduction of its own
_HALF = torch.float16
_LEAF_MONOTONE = {torch.nn.ReLU: _relu, torch.nn.Sigmoid: _sigmoid, torch.nn.Tanh: _tanh}


@functools.lru_cache(maxsize=1024)
def _module_op_name(cls: type) -> str:
    """A leaf module's op name: torch.nn.Linear, timm.layers.mlp.Mlp."""
    module = cls.__module__
    if module.startswith("torch.nn.modules."):
        module = "torch.nn"
    return f"{module}.{cls.__qualname__}"


class _Mode(TorchFunctionMode):
    """Sees each torch call made from Python while a step runs; hands it to the collector."""

    def __init__(self, col: "Numerics") -> None:
        super().__init__()
        self.col = col

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _compiling():  # torch.compile traces this mode too: nothing of ours may enter the user's graph
            return func(*args, **kwargs) if kwargs else func(*args)
        # Most calls are metadata or views: decided by one dict lookup, before anything else.
        try:
            kind = _kinds[func]
        except (KeyError, TypeError):
            kind = _classify(func)
        col = self.col
        if kind == SKIP or col.paused or not col.checking:
            return func(*args, **kwargs) if kwargs else func(*args)
        if kind == ALIAS:
            out = func(*args, **kwargs) if kwargs else func(*args)
            with _no_torch_function():
                col.alias(args[0], out)
            return out
        if kwargs is None:
            kwargs = {}
        if (col.pending or col.aliases) and (kind == SETITEM or _mutates.get(func) or "out" in kwargs):
            with _checks_range():
                col.resolve_written(args, kwargs)  # a deferred output is about to be overwritten
        if kind == SETITEM:
            return func(*args, **kwargs)
        if kind == BACKWARD:
            if not col.in_backward:  # (not a gradient a hand-written backward takes: no loss of the step)
                t0 = perf()
                with _checks_range():
                    col.on_backward(args, kwargs)
                col.check_s += perf() - t0
            col.in_backward += 1  # (a hand-written backward this pass runs is checked: see _install_backward_probe)
            try:
                return func(*args, **kwargs)
            finally:
                col.in_backward -= 1
        out = func(*args, **kwargs)
        t0 = perf()
        # (_checks_range, inline: this is the path every call takes. The modes below this one, the
        # user's and torch's default-device mode, see the call above, never the checks' reads)
        with _no_torch_function():
            try:
                if _profiling():
                    with torch.autograd.profiler.record_function(CHECKS_RANGE):
                        col.on_op(func, kind, args, kwargs, out)
                else:
                    col.on_op(func, kind, args, kwargs, out)
            except Exception as e:  # our bug must never become the user's failure
                col.failed(e)
        col.check_s += perf() - t0
        return out


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

    def names(self, col: "Numerics") -> tuple[list[str], list[str], int]:
        if self._names is None:
            self._names = col._names_of(self.params)
        return self._names


class Numerics:
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
        self.mstack: list[int] = []  # running modules, innermost last
        self.wstack: list[Any] = []  # for each: the user's line of its call if it is a library module
        self.lstack: list[bool] = []  # for each: whether its pre-hook took the mode off (a leaf)
        self.times_phases = False  # whether these hooks time the forward and optimizer phases
        self.fwd_t0 = self.opt_t0 = 0.0
        self.opt_frame: Any = None  # the frame that called the optimizer pre-hook, during the step
        self.opt_where: Any = None  # the user's line of that call, once found
        self._reset_step()

    # --- lifecycle ------------------------------------------------------------------------------

    def install(self) -> None:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        register_module_forward_pre_hook(self._module_pre)
        try:
            register_module_forward_hook(self._module_post, always_call=True)
        except TypeError:  # torch without always_call
            register_module_forward_hook(self._module_post)
        register_optimizer_step_pre_hook(self._opt_pre)
        register_optimizer_step_post_hook(self._opt_post)
        probes.read_traced_steps(self._traced_step_ran)
        # (dynamo traces and guards the mode stack it finds)
        compiled_calls_without(self.mode, self._compiled_call_starts, self._compiled_call_ran)
        probes.read_backward_calls(self._backward_in_compiled_call)
        # these hooks run where the probes' phase hooks do: time the phases here, one hook less
        self.times_phases = probes.take_over_phase_timing()
        _install_config_probes(self)
        _install_backward_probe(self)

    def step_begin(self, index: int) -> None:
        self.step = index
        dynamo_skips_our_frames()
        # (step_end left the state fresh: nothing writes it between steps, every writer asks
        # in_step first; after a step_end that failed before its reset, reset here)
        if not self.fresh:
            self._reset_step()
        self.fresh = False
        self.in_step = True
        self.paused = 0
        self.mode_popped = 0
        self.in_backward = 0
        if self.checking:
            self.mode.__enter__()

    def step_end(self, index: int) -> dict[str, Any] | None:
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
        self._reset_step()
        return data

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
        # (first op, end, Function) of each run of a hand-written backward (see _checked_backward)
        self.backward_fns: list[tuple[int, int, str]] = []
        self.fresh = True  # (see step_begin)

    # --- tables ---------------------------------------------------------------------------------

    def _new_tables(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.sent_sites < len(self.site_info):
            out["sites"] = {str(s["id"]): s for s in self.site_info[self.sent_sites:]}
            self.sent_sites = len(self.site_info)
        if self.sent_lists < len(self.param_lists):
            out["param_lists"] = {str(i): self.param_lists[i] for i in range(self.sent_lists, len(self.param_lists))}
            self.sent_lists = len(self.param_lists)
        if self.sent_modules < len(self.module_info):
            out["modules"] = {str(m["id"]): m for m in self.module_info[self.sent_modules:]}
            self.sent_modules = len(self.module_info)
        return out

    def _site(self, op: Any, depth: int, hazard: str | None = None) -> int:
        """The site of a call `depth` frames up: the op at the user's line. A call made by library
        code inside a library module (Linear inside Sequential) has the user's line of that
        module's call, found once by the module pre-hook, not per call. A call made straight from
        the user's code is looked up by its instruction (code object and offset), which names the
        same site every time: no walk, no line number worked out, on the path every call takes."""
        f = sys._getframe(depth)
        code = f.f_code
        kind = code_kinds.get(id(code))
        if kind == 0:  # (a user's code object: code_kinds keeps it, so its id names it)
            key = (op, id(code), f.f_lasti)
            try:
                sid = self.instr_sites.get(key)
            except TypeError:  # an unhashable callable
                return self._site_at(op, user_call(f), hazard, f)
            if sid is None:
                sid = self.instr_sites[key] = self._site_at(op, user_call(f), hazard, f)
            return sid
        w = self.wstack[-1] if self.wstack else None
        if w is not None and library_code(code):
            return self._site_at(op, w, hazard)
        return self._site_at(op, user_call(f), hazard, f)

    def _site_at(self, op: Any, where: Any, hazard: str | None = None, frame: Any = None) -> int:
        """Intern (op, the user's call): sites are sent once, steps refer to them by id. `op` is a
        name, a called function or a module class, named once, when its site is new; the same op
        reached through another callable shares the site. A `where` from user_call also holds the
        call's instruction: its columns are found in `frame`'s stack when the site is new."""
        key = (op, where)
        try:
            sid = self.sites.get(key)
        except TypeError:  # an unhashable callable
            op = _op_name.__wrapped__(op)
            key = (op, where)
            sid = self.sites.get(key)
        if sid is None:
            name = op if isinstance(op, str) else _module_op_name(op) if isinstance(op, type) else _op_name(op)
            sid = self.sites.get((name, where))
            if sid is None:
                sid = len(self.site_info)
                self.sites[(name, where)] = sid
                info = {"id": sid, "op": name, "where": _where(where, call_span(frame, where) if frame else None)}
                if hazard:
                    info["hazard"] = hazard
                self.site_info.append(info)
            self.sites[key] = sid
        return sid

    def _module_id(self, module: torch.nn.Module) -> int:
        entry = self.modules.get(id(module))
        if entry is not None and entry[0]() is module:
            return entry[1]
        if not self.mstack:  # a root call: name every submodule and parameter from here
            root = type(module).__name__
            for qual, sub in module.named_modules(remove_duplicate=False):
                e = self.modules.get(id(sub))
                if e is None or e[0]() is not sub:
                    self._add_module(sub, qual, root)
            held = None  # the global holding the root, for the root's own parameters
            for qual, p in module.named_parameters(remove_duplicate=False):
                owner = qual.rpartition(".")[0]
                if not owner and held is None:
                    held = _global_holding(module, sys._getframe(2)) or ""
                if not owner and held:
                    qual, owner = f"{held}.{qual}", held
                self.param_names[id(p)] = (weakref.ref(p), qual, owner or root)
            entry = self.modules.get(id(module))
            if entry is not None:
                return entry[1]
        parent = self.module_info[self.mstack[-1]] if self.mstack else None
        qual = f"{parent['name']}.{type(module).__name__}".lstrip(".") if parent else ""
        return self._add_module(module, qual, parent["root"] if parent else type(module).__name__)

    def _add_module(self, module: torch.nn.Module, qual: str, root: str) -> int:
        mid = len(self.module_info)
        self.modules[id(module)] = (weakref.ref(module), mid)
        self.module_info.append({"id": mid, "name": qual, "type": type(module).__name__, "root": root})
        return mid

    def param_name(self, p: torch.Tensor) -> str | None:
        e = self.param_names.get(id(p))
        return e[1] if e is not None and e[0]() is p else None

    def param_layer(self, p: torch.Tensor) -> str | None:
        """The qualified name of the module owning `p` (the root's class name for its own)."""
        e = self.param_names.get(id(p))
        return e[2] if e is not None and e[0]() is p else None

    # --- module hooks ---------------------------------------------------------------------------

    def _module_pre(self, module, args) -> None:
        if _compiling():
            return
        if not self.mstack:  # an outermost call: the forward phase starts
            self.fwd_t0 = perf()
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
            if len(self.mstack) == 1 and self.times_phases:  # (timed before our own work, as before)
                where = self.wstack[-1]  # (a library module's line, found by the pre-hook)
                probes.forward_done(module, self.fwd_t0, where if where is not None else user_frame(sys._getframe(1)))
            if self.lstack and self.lstack.pop():
                t0 = perf()
                # (before the mode is back, and unseen by the modes below it, as in _Mode: our own
                # reductions are not the user's calls)
                with _no_torch_function():
                    try:
                        if _profiling():  # (tested inline, as in _Mode: every library layer call)
                            with torch.autograd.profiler.record_function(CHECKS_RANGE):
                                self._on_leaf(module, args, output)
                        else:
                            self._on_leaf(module, args, output)
                    except Exception as e:  # our bug must never become the user's failure
                        self.failed(e)
                _push_mode(self.mode)
                self.check_s += perf() - t0
            self.mstack.pop()
            self.wstack.pop()

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

    # --- deferred checks (CPU) ------------------------------------------------------------------

    def _defer(self, resolve: Callable, payload: tuple, outs: Any) -> None:
        """Keep a CPU call's tensors instead of reducing them now: most of a step's checks, and
        all of their Python, are then never needed. The call's slot in `ops` keeps its place in
        execution order; `on_backward` settles it from the loss (`_settle`), a call about to
        overwrite its output reduces it first (`resolve_written`), and anything still pending at
        the optimizer step or the step's end is reduced then. `resolve(slot, *payload)` records it."""
        ops = self.ops
        if len(ops) >= MAX_OPS_PER_STEP:
            self.dropped += 1
            return
        i = len(self.deferred)
        self.deferred.append((len(ops), resolve, payload))
        ops.append(_PENDING)
        pending = self.pending
        for o in outs:
            # (a view is also written through its base: `h.mul_(...)` after `v = h.flatten()`)
            for key in (id(o),) if o._base is None else (id(o), id(o._base)):
                hit = pending.get(key)
                if hit is None:
                    pending[key] = [i]
                else:  # an in-place leaf (ReLU(inplace=True)) wrote into a deferred output
                    hit.append(i)
            self.deferred_bytes += o.nbytes
        if self.deferred_bytes > DEFER_MAX_BYTES:  # bounded: the kept tensors may outlive their use
            self.resolve_deferred()

    def _resolve(self, i: int) -> None:
        d = self.deferred[i]
        if d is None:
            return
        self.deferred[i] = None
        d[1](d[0], *d[2])

    def resolve_deferred(self) -> None:
        """Reduce every deferred call now, in execution order: as an eager check would have."""
        for i in range(len(self.deferred)):
            self._resolve(i)
        self._clear_deferred()

    def alias(self, src: Any, out: Any) -> None:
        """`out = src.data` / `src.detach()`: the same memory as `src`, but not a view of it, and
        `.data` does not even share its version counter. A write through `out` is a write into
        `src` (see resolve_written)."""
        if isinstance(out, torch.Tensor) and isinstance(src, torch.Tensor) and out is not src:
            self.aliases[id(out)] = (id(src),) if src._base is None else (id(src), id(src._base))

    def resolve_written(self, args: tuple, kwargs: dict) -> None:
        """A call is about to write into a tensor a deferred call made (`out += x`, `x[i] = v`,
        `relu_`): reduce that call first, while its output is still what it made. A write through
        an alias (`h.data[i] = v`) also forgets the statistics of `h`: its version did not move."""
        pending = self.pending
        aliases = self.aliases
        for t in (*args, *kwargs.values()):
            if isinstance(t, torch.Tensor):
                for u in (t, t._base):  # (a view writes into its base: `h[:, 0] += x`)
                    if u is None:
                        continue
                    ids = (id(u),)
                    if aliases:
                        ids += aliases.get(id(u), ())
                    for key in ids:
                        idx = pending.pop(key, None)
                        if idx is not None:
                            for i in idx:
                                self._resolve(i)
                        if key != ids[0]:  # (after the call that made it is reduced: it caches them)
                            self.cache.pop(key, None)

    def _settle(self, finite: bool) -> None:
        """The loss a backward pass starts from was computed from the deferred calls' outputs.
        Finite: they are taken as checked (a non-finite value made on the way would have reached
        the loss) and let go without a reduction.
        Not finite: each is reduced now, before the backward pass and the update change
        anything, and the step's origin is found among them as usual. They are reduced in a
        healthy step too, in the first LEARN_STEPS steps and every LEARN_EVERY-th: what makes
        non-finite values there by design (an attention mask's -inf) is learned as benign, so
        that a later step's origin is not blamed on it."""
        if finite and not (self.step < LEARN_STEPS or self.step % LEARN_EVERY == 0):
            for d in self.deferred:
                if d is not None:
                    self.ops[d[0]] = _VERIFIED
            self._clear_deferred()
        else:
            self.resolve_deferred()

    def _timed(self, fn: Callable, *args: Any) -> None:
        t0 = perf()
        with _checks_range():
            fn(*args)
        self.check_s += perf() - t0

    def _clear_deferred(self) -> None:
        self.deferred = []
        self.pending = {}
        self.deferred_bytes = 0

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
        lo, hi = torch.aminmax(_real(t.detach()))
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
        return refs, [_version_of(t) for t in refs]

    def _compiled_call_ran(self, compiled: Callable, args: tuple, kwargs: dict, out: Any, frame: Any,
                           started: tuple | None) -> None:
        """A call of compiled code, run with the mode off the stack (unseen.compiled_calls_without),
        checked as one call at the user's line that made it: its tensor arguments in, its result
        and the arguments it wrote into out, named `torch.compile(Net)` or `torch.compile(fn)`. A
        non-finite value made inside is then traced to this call, not taken for bad input data
        by the first checked call that receives it, nor blamed on the call that made a tensor
        the compiled code then overwrote. Deferred like a plain call on the CPU."""
        if started is None:
            return
        t0 = perf()
        refs, versions = started
        with _checks_range():
            try:
                outs = _tensors_in(out)
                outs += [t for t, v in zip(refs, versions)
                         if _version_of(t) != v and _checkable(t) and not any(t is o for o in outs)]
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

    def _backward_in_compiled_call(self, args: tuple, kwargs: dict) -> None:
        """A backward pass the user's code starts inside a call of compiled code (a compiled
        function that calls `loss.backward()`, run as it is after dynamo's graph break there), where
        the mode is off the stack (unseen.compiled_calls_without) and cannot see it: its loss is
        checked here, as the mode checks it elsewhere."""
        if in_compiled_call() and self.in_step and self.checking and not self.paused and not self.in_backward:
            t0 = perf()
            with _checks_range():
                self.on_backward(args, kwargs)
            self.check_s += perf() - t0

    # --- optimizer hooks ------------------------------------------------------------------------

    def _opt_pre(self, opt, args, kwargs) -> tuple | None:
        if _compiling():
            self._traced_opt_pre(opt)
            return None
        probes.settle_traced_steps()  # (compiled steps before this one are read first)
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
            self._timed(self.resolve_deferred)
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
        stack: with ours there, the user's graph was made of the calls our mode passes on, not of
        theirs (Adam's `lr / bias_correction1` traced as `bias_correction1.reciprocal() * lr`)."""
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
        if self.times_phases:
            probes.optimizer_done(opt, self.opt_t0, self._opt_user_line())
        self.opt_frame = None  # (a frame keeps its locals alive)
        t0 = perf()
        try:
            self._check_update(opt)
        finally:
            self.paused = max(0, self.paused - 1)
            if self.mode_popped:
                self.mode_popped -= 1
                _push_mode(self.mode)
            self.check_s += perf() - t0

    def _check_update(self, opt) -> None:
        """The weights after `opt`'s update (recorded by `_record_grads` before it) are checked."""
        grad_mode = torch.is_grad_enabled()
        try:
            if self.in_step and self.checking and self.opt_steps and self.opt_steps[-1]["plan"].ref() is opt:
                _set_grad(False)
                rec = self.opt_steps[-1]
                params = rec["plan"].params
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
                ms = torch._foreach_norm(ps, math.inf)
                for p, mx in zip(ps, ms):
                    self.param_stats[id(p)] = (weakref.ref(p), p._version, None, mx, self.step, True)
                    refs.append((self.values.add(mx), None))
                continue
            for p in ps:
                lo, hi = torch.aminmax(_real(p.detach()))
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
        return rec

    def _plan_of(self, opt) -> "_OptPlan":
        """What the optimizer hooks need to know of an optimizer, kept while its param groups
        stay the same lists with the same lengths (worked out in each hook of every step, it cost
        ~0.1 ms of Python a step)."""
        groups = opt.param_groups
        key = tuple([(id(g["params"]), len(g["params"])) for g in groups])
        plan = self.opt_plans.get(id(opt))
        if plan is not None and plan.key == key and plan.ref() is opt:
            return plan
        idx = self.opt_index.get(opt)
        if idx is None:
            idx = self._register_optimizer(opt, None)
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

    # --- configuration probes (called from _install_config_probes) --------------------------------

    def event(self, kind: str, where: Any, **data: Any) -> None:
        self.events.append({"event": kind, "step": self.step if self.in_step else -1,
                            "where": _where(where), **data})

    def _register_optimizer(self, opt, where) -> int:
        idx = len(self.opt_index)
        self.opt_index[opt] = idx
        defaults = getattr(opt, "defaults", {}) or {}
        self.event("optimizer", where, opt=idx, type=type(opt).__name__,
                   lr=_scalar(defaults.get("lr")), defaults=_plain(defaults),
                   group_lrs=[_scalar(g.get("lr")) for g in opt.param_groups],
                   params=sum(len(g["params"]) for g in opt.param_groups))
        return idx

    # --- step end -------------------------------------------------------------------------------

    def _materialise(self, index: int) -> dict[str, Any]:
        vals = self.values.read()
        data: dict[str, Any] = {"ops": len(self.ops), "dropped": self.dropped, "backward": self.backward}
        bad_ops = []
        hazards: dict[int, float] = {}
        for k, op in enumerate(self.ops):
            if not op:  # a deferred call the loss showed finite
                continue
            site, _, _, out_refs, hazard, half, kind, _ = op
            if not all(_finite(vals[r], vals[r + 1]) for r in out_refs):
                bad_ops.append(k)
            if hazard is not None or half:
                v = _hazard_value(hazard, vals) if hazard is not None else None
                if half:
                    r = out_refs[0]
                    v = max(abs(vals[r]), abs(vals[r + 1])) if v is None else v
                if v is None or (len(hazards) >= MAX_HAZARD_SITES and site not in hazards):
                    continue
                prev = hazards.get(site)
                low = hazard is not None and hazard[0] != "max_in"
                # (a later call at the same line that received a NaN does not hide how close the
                # first came to its hazard: NaN only when no call there measured a number)
                if prev is None or math.isnan(prev):
                    hazards[site] = v
                elif not math.isnan(v):
                    hazards[site] = min(prev, v) if low else max(prev, v)
        data["nonfinite_ops"] = len(bad_ops)
        data["nonfinite_sites"] = sorted({self.ops[k][0] for k in bad_ops})
        data["hazards"] = [[s, num(v)] for s, v in hazards.items()]
        loss_vals = [(vals[r], vals[r + 1]) for r in self.losses]
        if loss_vals:
            lo, hi = loss_vals[-1]
            data["loss"] = num(hi if lo == hi or math.isnan(hi) else (lo + hi) / 2)
        data["losses"] = len(loss_vals)
        loss_bad = any(not _finite(lo, hi) for lo, hi in loss_vals)
        data["loss_finite"] = not loss_bad if loss_vals else None
        data["opt_steps"] = [self._opt_record(r, vals) for r in self.opt_steps]
        grads_bad = any(r.get("grad_nonfinite") for r in data["opt_steps"])
        params_bad = any(r.get("param_nonfinite") for r in data["opt_steps"])
        data["autocast"] = [[s, n] for s, n in self.autocast_used.items()]
        data["scaler_scale_calls"] = self.scale_calls
        data["scaler_updates"] = [{"scaler": i, "before": num(vals[b]) if b is not None else None,
                                   "after": num(vals[a])} for i, b, a in self.scaler_updates]
        if loss_bad or grads_bad or params_bad:
            if self.origins < MAX_ORIGINS:
                self.origins += 1
                data["origin"] = self._origin(index, vals, bad_ops, hazards, loss_bad, data["opt_steps"])
        else:
            # (a call with weights among its inputs that overflows is never by design: a float16
            # Linear at ±inf that a ReLU hides is the NaN of a later step, not an attention mask)
            self.benign_sites.update(self.ops[k][0] for k in bad_ops if not self._weighted(self.ops[k]))
        return data

    def _opt_record(self, r: dict, vals: list) -> dict[str, Any]:
        """One optimizer step's record. The per-parameter values go out as they are, with the id
        of their names in `param_lists`; which parameters and layers dominate is worked out by the
        reader (auditor.rules.nonfinite.NumericsView), not here, in every training step."""
        out = {"opt": r["opt"], "site": r["site"], "sched_epochs": r["sched_epochs"],
               "lrs": [num(vals[v[1]]) if isinstance(v, tuple) else _scalar(v) for v in r["lrs"]]}
        if "grad_norms" in r:
            norms = vals[r["grad_norms"]]
            names, _, lid = r["grad_list"]
            out["grads"] = lid
            if all(map(math.isfinite, norms)):
                out["grad_norm"] = num(math.hypot(*norms))
                out["grad_norms"] = norms
                out["grad_nonfinite"] = 0
            else:
                out["grad_norm"] = "nan"
                out["grad_norms"] = [num(n) for n in norms]
                bad = [names[i] for i, n in enumerate(norms) if not math.isfinite(n)]
                out["grad_nonfinite"] = len(bad)
                out["grad_nonfinite_params"] = bad[:20]
        if r.get("fp16_grads"):
            out["fp16_grads"] = r["fp16_grads"]
        if r.get("compiled"):
            out["compiled"] = True
        if r.get("param_trusted"):
            out["params_checked"] = "trusted"  # a safe update of finite weights (see _update_keeps_finite)
        if "param_maxabs" in r:
            out["params_checked"] = "measured"
            # (min, max) per parameter on the CPU, max|w| (one value) on CUDA
            maxabs = [_max_abs(vals[a], vals[b] if b is not None else vals[a]) for a, b in r["param_maxabs"]]
            names = r["param_list"][0]
            bad = [names[i] for i, n in enumerate(maxabs) if not math.isfinite(n)]
            out["param_max_abs"] = num(max(maxabs) if not bad else float("nan"))
            out["param_nonfinite"] = len(bad)
            out["param_nonfinite_params"] = bad[:20]
        return out

    def _weighted(self, op: tuple) -> bool:
        """Whether a recorded call had one of the model's parameters among its inputs."""
        names = self.param_names
        return any((e := names.get(i)) is not None and e[0]() is not None for i in op[7])

    def _origin(self, index: int, vals: list, bad_ops: list[int], hazards: dict[int, float],
                loss_bad: bool, opt_steps: list[dict]) -> dict[str, Any]:
        """Where the step's non-finite values came from, in execution order: the first call at a
        site that has not made non-finite values in healthy steps (an attention mask's -inf is
        by design), else the backward pass, else the optimizer's update.

        A call that only received ±inf (no NaN) from a tensor no checked call of the step made
        (a mask written with `pad[:, 4:] = -inf`, first in a step too late for the healthy steps
        that teach what is by design) is blamed only if nothing else explains the step: a later
        call that made non-finite values from finite ones (a division by zero), or, when the loss
        stayed finite, the backward pass or the update. A later call that merely received
        non-finite values leaves the blame with it (a row masked whole: softmax of all -inf)."""
        what = [w for w, bad in (("loss", loss_bad), ("gradient", any(r.get("grad_nonfinite") for r in opt_steps)),
                                 ("parameter", any(r.get("param_nonfinite") for r in opt_steps))) if bad]
        base = {"step": index, "nonfinite": what, "ops_checked": len(self.ops),
                "hazards": [[s, num(v)] for s, v in hazards.items()]}
        made = {r for op in self.ops if op for r in op[3]}  # values the step's checked calls made
        fallback = None
        for k in bad_ops:
            site, module, in_refs, out_refs, hazard, half, kind, params = self.ops[k]
            if site in self.benign_sites:
                continue
            fn = next((name for a, b, name in self.backward_fns if a <= k < b), None)
            ins = [_range(vals, r, r in self.sym_refs) if r is not None else {"min": None, "max": None, "finite": True}
                   for r in in_refs]
            for r, rng in zip(in_refs, ins):
                if r in self.stale_refs:
                    rng["measured_at_step"] = self.stale_refs[r]
            for i, rng in enumerate(ins):
                name = self.param_names.get(params[i]) if params and i < len(params) else None
                if name is not None and name[0]() is not None:
                    rng["param"] = name[1]
            out = [_range(vals, r) for r in out_refs]
            cause = _cause(kind, hazard, vals, ins, out, half)
            if fn is not None:  # an op of a hand-written backward (see _install_backward_probe)
                if cause["kind"] == "nonfinite-input":
                    continue  # a gradient that came in non-finite: made by the backward pass before it
                bad = next((r for r in opt_steps if r.get("grad_nonfinite")), None)
                return {**base, "phase": "backward", "function": fn, "op_index": k, "site": site,
                        "module": module, "inputs": ins[:8], "outputs": out[:4], "hazard": cause,
                        "params": bad["grad_nonfinite_params"] if bad else [],
                        **({"opt": bad["opt"]} if bad else {})}
            found = {**base, "phase": "input" if cause["kind"] == "nonfinite-input" else "forward",
                     "op_index": k, "site": site, "module": module, "inputs": ins[:8], "outputs": out[:4],
                     "hazard": cause}
            if cause["kind"] == "nonfinite-input":
                if all(r is not None and r not in made and "nan" not in (rng["min"], rng["max"])
                       for r, rng in zip(in_refs, ins) if not rng["finite"]):
                    fallback = fallback or found  # (an infinity from outside: a mask, by design, most likely)
                    continue
                if fallback is not None:  # passing on what came from outside: that was the start after all
                    return fallback
            return found
        if fallback is not None and loss_bad:
            return fallback
        for r in opt_steps:
            if r.get("grad_nonfinite"):
                hints = [[s, num(v)] for s, v in hazards.items() if v == 0.0]
                return {**base, "phase": "backward", "params": r["grad_nonfinite_params"], "opt": r["opt"],
                        "hazard": {"kind": "backward", "singular_sites": hints}}
            if r.get("param_nonfinite"):
                return {**base, "phase": "optimizer", "params": r["param_nonfinite_params"], "opt": r["opt"],
                        "site": r["site"], "hazard": {"kind": "update"}}
        return fallback or {**base, "phase": "unknown", "hazard": {"kind": "unknown"}}


def _global_holding(obj: Any, frame: Any) -> str | None:
    """The name of a global of the user's code calling at `frame` (or above it) that holds `obj`.
    A root module's own parameters are named `weight`, `bias` by the module itself: two layers
    held by two globals (`emb`, `proj`), each called on its own, had both gradients named
    `weight`; they are `emb.weight`, `proj.weight`, as a root module would have named them."""
    f = frame
    while f is not None and library_code(f.f_code):
        f = f.f_back
    if f is None:
        return None
    for name, v in f.f_globals.items():
        if v is obj and not name.startswith("__"):
            return name
    return None


def _finite_norms(tensors: list[torch.Tensor], norms: list[float]) -> list[float]:
    """The norms, with each that is not finite taken again in float64. A float32 norm is inf as
    soon as the sum of squares passes 3.4e38 (a norm of 1.8e19), though every element is finite:
    a diverging run's gradient gets there steps before any value in it does, and was reported as
    non-finite at that step. A NaN or inf element keeps the norm non-finite in float64 too. (The
    CPU path only: on CUDA the norms are read at the step's end, without a sync before.)"""
    if math.isfinite(sum(norms)):  # (the common case: one sum in C; float32 norms cannot overflow it)
        return norms
    return [n if math.isfinite(n) else _TB.item(torch.linalg.vector_norm(t, dtype=torch.float64))
            for t, n in zip(tensors, norms)]


def params_names(col: Numerics, params: list[torch.Tensor]) -> list[str]:
    return [col.param_name(p) or f"param{i}{list(p.shape)}" for i, p in enumerate(params)]


def _max_abs(lo: float, hi: float) -> float:
    return max(abs(lo), abs(hi)) if _finite(lo, hi) else float("nan")


def _range(vals: list, ref: int, symmetric: bool = False) -> dict[str, Any]:
    lo, hi = vals[ref], vals[ref + 1]
    out = {"min": num(lo), "max": num(hi), "finite": _finite(lo, hi)}
    if symmetric:
        out["abs"] = True  # a weight's range after an update: ±max|w|
    return out


def _hazard_value(hazard: tuple, vals: list) -> float | None:
    what, ref = hazard
    if what == "min_abs_den_const":
        return ref
    return vals[ref]


def _cause(kind: int, hazard: tuple | None, vals: list, ins: list[dict], out: list[dict], half: bool) -> dict:
    """Name the hazard that turned finite inputs into a non-finite result."""
    if any(not r["finite"] for r in ins):
        bad = next(i for i, r in enumerate(ins) if not r["finite"])
        return {"kind": "nonfinite-input", "input": bad, "param": ins[bad].get("param")}
    v = _hazard_value(hazard, vals) if hazard is not None else None
    has_nan = any(o["min"] == "nan" or o["max"] == "nan" for o in out)
    has_inf = any(o["max"] == "inf" or o["min"] == "-inf" for o in out)
    if kind == COMPILED:  # (its own calls were not checked: which of them made it is not known)
        return {"kind": "compiled"}
    if kind in (LOG, LOG1P) and v is not None and v <= (-1.0 if kind == LOG1P else 0.0):
        return {"kind": "log-of-zero" if v == (-1.0 if kind == LOG1P else 0.0) else "log-of-negative",
                "min_input": num(v)}
    if kind in (DIV, RDIV) and v is not None and v == 0.0:
        return {"kind": "division-by-zero", "min_abs_denominator": 0.0}
    if kind == SQRT and v is not None and v < 0:
        return {"kind": "sqrt-of-negative", "min_input": num(v)}
    if kind == EXP and v is not None and has_inf:
        return {"kind": "exp-overflow", "max_input": num(v)}
    if half and (has_inf or any(isinstance(r.get(k), (int, float)) and abs(r[k]) > FP16_MAX
                                for r in ins for k in ("min", "max"))):
        # (a float32 input past 65504 that autocast casts to float16 inside the call: inf, then NaN)
        return {"kind": "fp16-overflow", "limit": FP16_MAX}
    if has_inf and not has_nan:
        return {"kind": "overflow"}
    return {"kind": "invalid"}  # NaN from finite inputs: inf - inf, 0 * inf, 0 / 0 inside the call


def _where(w: Any, span: tuple[int, int, int, int] | None = None) -> dict | None:
    if not w:
        return None
    out = {"file": w[0], "line": w[1], "function": w[2]}
    if span is not None:  # where on the line the call is: (line, end line, column, end column)
        out["span"] = list(span)
    return out


def _scalar(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.detach().cpu().item() if v.device.type == "cpu" else None  # never sync a device here
    if isinstance(v, float):
        return num(v)
    return v if isinstance(v, (int, bool, str)) or v is None else None


def _plain(d: dict) -> dict[str, Any]:
    """The scalar (and tuple-of-scalar) entries of a settings dict, JSON-ready."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, (list, tuple)) and len(v) <= 64 and all(isinstance(x, (int, float, bool)) for x in v):
            out[str(k)] = [_scalar(x) for x in v]
        elif not isinstance(v, (list, tuple, dict)):
            s = _scalar(v)
            if s is not None:
                out[str(k)] = s
    return out


# --- configuration probes ------------------------------------------------------------------------

def _wrap(owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    orig = owner.__dict__.get(name)
    if orig is None or getattr(orig, "__audit_numerics__", False):
        return
    new = make(orig)
    functools.update_wrapper(new, orig)
    new.__audit_numerics__ = True
    setattr(owner, name, new)


def _install_backward_probe(col: Numerics) -> None:
    """Check the ops of a hand-written backward (a `torch.autograd.Function` of the user's) as the
    step's own. torch calls it from C++ during `loss.backward()`, while the mode is off the stack
    (it is handling `backward`), so its ops went unseen: a division by a norm that is 0 on a
    padding row there was blamed on a norm of the forward pass whose derivative never ran. The
    mode is pushed back for that call only, if the backward pass is the step's (started through
    the mode) and the Function is the user's: torch's own (checkpoint's recompute, the module
    backward hooks' Function) and a step without such a Function cost nothing more. The ops are
    checked as they happen, not deferred: no loss comes after them to settle them."""
    owner = getattr(torch.autograd.function, "BackwardCFunction", None)
    if owner is None:  # pragma: no cover - a torch without it
        return
    users: "weakref.WeakKeyDictionary[type, str | None]" = weakref.WeakKeyDictionary()  # -> "Name.backward", the user's

    def make(orig: Callable) -> Callable:
        def probe(self, *args):
            if not col.in_backward or col.paused or not col.checking or _compiling():
                return orig(self, *args)
            cls = getattr(self, "_forward_cls", None)
            name = users.get(cls, False) if cls is not None else None
            if name is False:
                name = users[cls] = None if _library_module(cls) else f"{cls.__qualname__}.backward"
            n = _stack_len()
            if name is None or (n and _stack_at(n - 1) is col.mode):
                return orig(self, *args)
            start = len(col.ops)
            defer, col.defer_cpu = col.defer_cpu, False
            _push_mode(col.mode)
            try:
                return orig(self, *args)
            finally:
                if _stack_len() > n and _top_mode() is col.mode:
                    _pop_mode()
                col.defer_cpu = defer
                if len(col.ops) > start:
                    col.backward_fns.append((start, len(col.ops), name))
        return probe

    for method in ("apply", "apply_boxed"):
        _wrap(owner, method, make)


def _caller() -> Any:
    return user_frame(sys._getframe(2))


def _install_config_probes(col: Numerics) -> None:
    """Record what the configuration says: optimizer and scheduler construction, state loads,
    GradScaler use and autocast regions. Each probe calls the original first and only reads."""
    from torch.optim import Optimizer, lr_scheduler

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

    def make_sched_step(orig):
        def probe(self, *args, **kwargs):
            if not _compiling():
                probes.settle_traced_steps()  # (a compiled step's learning rates, read before they change)
            return orig(self, *args, **kwargs)
        return probe

    import torch.utils.data.dataloader as dl

    _wrap(dl._BaseDataLoaderIter, "__next__", make_outside_mode)
    _wrap(Optimizer, "zero_grad", make_zero_grad)
    _wrap(torch.nn.Module, "zero_grad", make_zero_grad)
    _wrap(Optimizer, "__init__", make_opt_init)
    _wrap(Optimizer, "load_state_dict", make_opt_load)
    _wrap(lr_scheduler.LRScheduler, "__init__", make_sched_init)
    _wrap(lr_scheduler.LRScheduler, "step", make_sched_step)
    for wrapper in ("SequentialLR", "ChainedScheduler", "ReduceLROnPlateau"):  # no LRScheduler.__init__, .step
        cls = getattr(lr_scheduler, wrapper, None)
        if cls is not None:
            _wrap(cls, "__init__", make_sched_init)
            _wrap(cls, "step", make_sched_step)
    _wrap(lr_scheduler.LRScheduler, "load_state_dict", make_sched_load)
    _install_amp_probes(col, guard)


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


def _install_amp_probes(col: Numerics, guard: Callable) -> None:
    from torch.amp import autocast_mode, grad_scaler
    import torch.nn.utils as nn_utils
    import torch.nn.utils.clip_grad as clip_grad

    # The scale a GradScaler put in the gradients (scale(loss).backward()) is in them until
    # unscale_(opt), or step(opt), which unscales first: scaler -> ids of the optimizers it has
    # unscaled since its last scale(). Clipping before that clips scaled gradients.
    scaled: "weakref.WeakKeyDictionary[Any, set[int]]" = weakref.WeakKeyDictionary()

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
            col.autocast_used[sid] = col.autocast_used.get(sid, 0) + 1

    def make_enter(orig):
        def probe(self, *args, **kwargs):
            where = _caller()
            result = orig(self, *args, **kwargs)
            after_enter(self, where)
            return result
        return probe

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

    def make_clip(orig, what: str, limit_name: str):
        def probe(parameters, *args, **kwargs):
            if not (scaled and col.in_step and not col.paused):
                return orig(parameters, *args, **kwargs)
            # (a generator of parameters is read once, here, and handed on as the list it gave)
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            after_clip(params, what, args[0] if args else kwargs.get(limit_name), sys._getframe(1))
            return orig(params, *args, **kwargs)
        return probe

    _wrap(autocast_mode.autocast, "__enter__", make_enter)
    _wrap(grad_scaler.GradScaler, "unscale_", make_unscaling)
    _wrap(grad_scaler.GradScaler, "step", make_unscaling)
    _wrap(grad_scaler.GradScaler, "__init__", make_scaler_init)
    _wrap(grad_scaler.GradScaler, "scale", make_scale)
    _wrap(grad_scaler.GradScaler, "update", make_update)
    for owner in (nn_utils, clip_grad):
        _wrap(owner, "clip_grad_norm_", lambda orig: make_clip(orig, "clip_grad_norm_", "max_norm"))
        _wrap(owner, "clip_grad_value_", lambda orig: make_clip(orig, "clip_grad_value_", "clip_value"))
