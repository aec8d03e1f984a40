"""Cheap runtime probes on the torch APIs that cause trouble.

Each probe wraps one API, attributes the call to the user's line and adds it to a per-step tally
(count and time). Probes never change arguments or results: audited and plain runs compute the
same numbers. They are installed before the target module is imported, so module-level calls
(e.g. `torch.autograd.set_detect_anomaly(True)`) are seen too.

Calls made by torch itself (e.g. `Tensor.backward` calling `torch.autograd.backward`, or
`Tensor.__format__` calling `.item()`) are not counted again: only calls whose immediate caller is
outside torch and the auditor are.
"""
from __future__ import annotations

import functools
import gc
import inspect
import os
import sys
import warnings
import weakref
import time
from itertools import chain
from typing import Any, Callable

import torch
from torch.nn.modules import module as _nn_module
from torch.optim import optimizer as _optimizer

from auditor.capture import saved_tensors
from auditor.capture.bench_switches import OFF
from auditor.capture.frames import is_torch_internal, library_code, on_forget, user_frame, user_place
from auditor.capture.frames import via_data as _via
from auditor.capture.one_call import OneCall, compiled_anything
from auditor.capture.probes import graph_use
from auditor.capture.probes.graph_use import graph_of
from auditor.capture.probes.indexing import index_sync
from auditor.capture.unseen import TracedCalls, no_torch_function, recorded_warnings
from auditor.evidence import model as m

perf, _grad_on = time.perf_counter, torch.is_grad_enabled  # (a sync under no_grad is tallied so: an eval loop)
FrameKey = tuple[str, int, str] | None
# Inside code torch.compile traces, a probe is the call it wraps: traced, its frame reads and timers
# would be graph breaks in the user's graph, each with a warning naming what dynamo cannot trace
# (sys._getframe, time.perf_counter), and a timer's value a guard that recompiles it. Where dynamo
# gives up on a call, it runs it as it is, and the probe records it there.
_compiling = torch.compiler.is_compiling


class Recorder:
    """Per-step tallies, shared by every probe. One per process; inert in forked children."""

    def __init__(self) -> None:
        # False in a forked child (DataLoader workers: their calls are not the step's); every probe
        # reads it first, as an attribute (no getpid, no method call)
        self.active = True
        self.in_data = 0  # > 0 while inside DataLoader iteration
        self.tallies: dict[tuple, dict[str, Any]] = {}
        self.dataloaders: list[dict[str, Any]] = []
        self.retain_events: list[dict[str, Any]] = []  # retain_graph=True backwards of this step
        self.retain_watched: list[dict[str, Any]] = []  # the last step's, unused in it
        self.retain_sampled: dict[FrameKey, int] = {}
        self.retain_alive: dict[FrameKey, int] = {}  # retained graphs alive now, per place
        self.hook_holders: dict[tuple, set[int]] = {}  # HOOK tally -> ids of what it registered on, this step
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self.active = False

    def add(self, kind: str, what: str, where: FrameKey, ms: float = 0.0, **data: Any) -> None:
        key = (kind, what, where, tuple(sorted(data.items())) if data else ())
        t = self.tallies.get(key)
        if t is None:
            self.tallies[key] = {"kind": kind, "what": what, "where": where, "count": 1, "ms": ms, "data": data}
        else:
            t["count"] += 1
            t["ms"] += ms

    def add_sums(self, kind: str, what: str, where: FrameKey, fixed: tuple, **sums: Any) -> None:
        """One more call at `where`, one tally per (kind, what, where, fixed): `fixed` is its
        (name, value) pairs of data that tell tallies apart, `sums` is data added up over the calls."""
        key = (kind, what, where, fixed)
        t = self.tallies.get(key)
        if t is None:
            self.tallies[key] = {"kind": kind, "what": what, "where": where, "count": 1, "ms": 0.0,
                                 "data": {**dict(fixed), **sums}}
        else:
            t["count"] += 1
            data = t["data"]
            for k, v in sums.items():
                data[k] += v

    def hook_added(self, what: str, where: FrameKey, holder: Any, held: int) -> None:
        """A hook registered at `where` on `holder` (a tensor, a module), which holds `held`
        hooks of that kind now: the step's tally keeps the most, and on how many holders."""
        key = (m.HOOK, what, where, ())
        t = self.tallies.get(key)
        if t is None:
            t = self.tallies[key] = {"kind": m.HOOK, "what": what, "where": where, "count": 0, "ms": 0.0,
                                     "data": {"held": 0, "holders": 0}}
        t["count"] += 1
        if held > t["data"]["held"]:
            t["data"]["held"] = held
        ids = self.hook_holders.setdefault(key, set())
        ids.add(id(holder))
        t["data"]["holders"] = len(ids)

    def drain(self, graphs: bool = True) -> list[dict[str, Any]]:
        """Tallies since the last drain, as plain dicts ready to send; finalises retain events.
        A graph unused in its own step is counted unused and watched one step more: if that step's
        backward runs into it, a tensor carried across steps holds it, and it is counted again as
        carried (the rule tells the two apart: dropping retain_graph there breaks the next step)."""
        settle_traced_steps()
        if _aside[0]:  # (an update that raised skipped its post-hooks: no probe stays aside past its step)
            _aside[:] = [0, False]
        if graphs:  # (False: the graphs freed so far are told at a later drain, a step's or the run's end)
            graph_use.fold(self.add)
        if not (self.tallies or self.retain_events or self.retain_watched or self.hook_holders):
            return []  # (most drains, at every step boundary: nothing below to do)
        for ev in self.retain_watched:
            if ev["used"][0]:
                t = self.tallies.setdefault((m.RETAINED_CARRIED, ev["what"], ev["where"], ()), {
                    "kind": m.RETAINED_CARRIED, "what": ev["what"], "where": ev["where"], "count": 0, "ms": 0.0,
                    "data": {}})
                t["count"] += 1
        self.retain_watched = [ev for ev in self.retain_events if not ev["used"][0]]
        for ev in self.retain_events:
            if ev["used"][0]:
                continue
            # one tally per place; its data keeps the largest graph seen there (only the first
            # few retained graphs per place have their saved bytes measured)
            t = self.tallies.setdefault((m.RETAINED_UNUSED, ev["what"], ev["where"], ()), {
                "kind": m.RETAINED_UNUSED, "what": ev["what"], "where": ev["where"], "count": 0, "ms": 0.0,
                "data": {"graph_nodes": 0, "saved_bytes": 0, "alive_at_once": 0}})
            t["count"] += 1
            t["data"]["graph_nodes"] = max(t["data"]["graph_nodes"], ev["nodes"])
            t["data"]["saved_bytes"] = max(t["data"]["saved_bytes"], ev["saved_bytes"])
            if ev["saved_partial"]:  # (some saved values packed by hooks, not read: a lower bound)
                t["data"]["saved_partial"] = True
            if ev["alive"] is None or t["data"]["alive_at_once"] is None:
                t["data"]["alive_at_once"] = None  # (unknown: every graph counts)
            else:
                t["data"]["alive_at_once"] = max(t["data"]["alive_at_once"], ev["alive"])
        self.retain_events = []
        self.hook_holders = {}
        out = []
        for t in self.tallies.values():
            w = t["where"]
            out.append({**t, "where": {"file": w[0], "line": w[1], "function": w[2]} if w else None})
        self.tallies = {}
        return out


REC: Recorder | None = None


def _device_type(t: Any) -> str:
    return t.device.type if isinstance(t, torch.Tensor) else "cpu"


# Where a tensor lives, as the rules should judge it. CUDA rehearsal (auditor.capture.rehearsal)
# replaces this before install() so tensors the program meant for the GPU count as "cuda".
DEVICE_OF: Callable[[Any], str] = _device_type
# True when only syncs on "cuda" tensors count (a real GPU, or a rehearsal of one).
JUDGE_AS_CUDA: bool = torch.cuda.is_available()


# A call made from these is a torch-function mode's or a tensor subclass's handler passing on a
# call it intercepted (`return func(*args, **kwargs)`): the probe already saw that call where it was
# made (the user's line, or the auditor's own check), and must not count it again at the handler.
_DISPATCHERS = frozenset(("__torch_function__", "__torch_dispatch__"))


def _user_call(depth: int = 2):
    """The calling frame if the call is the user's (not torch calling itself), else None."""
    f = sys._getframe(depth)
    code = f.f_code
    return None if is_torch_internal(code.co_filename) or code.co_name in _DISPATCHERS else f


def _wrap(owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    orig = getattr(owner, name)
    if getattr(orig, "__audit_original__", None) is not None:
        return  # already wrapped
    new = make(orig)
    functools.update_wrapper(new, orig)
    new.__audit_original__ = orig
    _WRAPPED.append((owner, name, vars(owner).get(name, orig) if isinstance(owner, type) else orig))
    setattr(owner, name, new)
    if _part_on[1]:
        _PART.append((owner, name, orig, new))


# every wrapper the probes put on torch: (owner, name, what was there), put back in a DataLoader
# worker (workers.forked)
_WRAPPED: list[tuple[Any, str, Any]] = []


# the wrappers of the bench's "probes" part (auditor.capture.bench_switches), kept as they are made
# for set_part_probes: (owner, name, original, wrapper)
_PART: list[tuple[Any, str, Any, Any]] = []
_part_on = [True, False]  # [the part's wrappers in place, the wrappers made now are the part's]


def set_part_probes(on: bool) -> None:
    """The "probes" part's wrappers put back (on) or taken out (bench_steady_parts.py --toggle only:
    each swap costs CPython's attribute caches, so only at the blocks' edges)."""
    if on != _part_on[0] and _PART:
        _part_on[0] = on
        for owner, name, orig, new in _PART:
            setattr(owner, name, new if on else orig)


# --- device->host synchronisations -------------------------------------------------------------

# torch's own code that syncs on every call of a public API the user makes: that wait is the
# user's cost, at the line of their call. GradScaler.step reads each device's found_inf with
# `.item()` before it lets the optimizer step, unless the optimizer is fused (Adam, AdamW, SGD with
# fused=True), which takes the inf check on the device itself. ReduceLROnPlateau.step(metric) reads
# its metric with `float()`: a device tensor (the loss) is fetched at each call. Code object -> what
# it is called.
_INTERNAL_SYNCS: dict[Any, str] = {}
_INTERNAL_SYNCS_LABELS = ("GradScaler.step",)


# torch.utils.tensorboard is a logging library that ships inside torch: SummaryWriter.add_scalar
# of a device tensor fetches it (`.cpu()`) at the user's call, like any logger
_TB_DIR = os.path.normcase(os.path.join(os.path.realpath(os.path.dirname(torch.__file__)), "utils", "tensorboard"))
_in_tb: dict[str, bool] = {}


def _logging_sync(filename: str, what: str) -> str | None:
    v = _in_tb.get(filename)
    if v is None:
        v = _in_tb[filename] = os.path.normcase(os.path.realpath(filename)).startswith(_TB_DIR)
    # (its .numpy() is of the host copy .cpu() just made: one sync, counted once)
    return f"SummaryWriter: {what}" if v and what != "Tensor.numpy" else None


def _register_internal_syncs() -> None:
    try:
        from torch.distributions.distribution import Distribution

        # (it checks a distribution's arguments when it is made, and a value given to log_prob, by
        # default, and tests each check's result on the host: `if not torch._is_all_true(valid)`)
        _INTERNAL_SYNCS[Distribution.__init__.__code__] = m.DISTRIBUTION_CHECK
        _INTERNAL_SYNCS[Distribution._validate_sample.__code__] = m.DISTRIBUTION_CHECK
    except (ImportError, AttributeError):
        pass
    try:
        from torch.optim.lr_scheduler import ReduceLROnPlateau

        _INTERNAL_SYNCS[ReduceLROnPlateau.step.__code__] = "ReduceLROnPlateau.step"
    except (ImportError, AttributeError):
        pass
    try:
        from torch.amp.grad_scaler import GradScaler

        code = GradScaler._maybe_opt_step.__code__
    except (ImportError, AttributeError):
        return
    _INTERNAL_SYNCS[code] = "GradScaler.step"
    for c in code.co_consts:  # the generator expression that calls .item()
        if hasattr(c, "co_code"):
            _INTERNAL_SYNCS[c] = "GradScaler.step"


def _internal_sync_device(f: Any, t: Any) -> str:
    """The device a sync made on the user's behalf waits for: the tensor's, or the device the
    owning GradScaler was created for (in CUDA rehearsal a "cuda" scaler does its arithmetic on
    host tensors, and says so in `_audit_device`)."""
    while f is not None and f.f_code in _INTERNAL_SYNCS:
        owner = f.f_locals.get("self")
        if owner is not None:
            return getattr(owner, "_audit_device", None) or DEVICE_OF(t)
        f = f.f_back
    return DEVICE_OF(t)


_WARNED: dict = {}  # the warnings registry of relocated warnings: each shown once per line, as Python does


def _warnings_at_caller(orig: Callable) -> Callable:
    """`orig`, but the warnings it raises on a tensor that requires grad (torch's "Converting a
    tensor with requires_grad=True to a scalar" for `float(loss)`) name the user's line, not the
    probe that called it. Only such tensors pay for catching warnings."""
    def call(self, *args, **kwargs):
        with no_torch_function():  # (the auditor's read: the user's torch-function modes see the call only)
            requires_grad = self.requires_grad
        if not requires_grad:
            return orig(self, *args, **kwargs)
        try:
            with recorded_warnings() as caught:  # (not catch_warnings: see unseen.recorded_warnings)
                return orig(self, *args, **kwargs)
        finally:  # (outside the catching block: re-raised there, they would be caught again)
            where = user_frame(sys._getframe(1))  # (the probe's caller)
            for w in caught:
                warnings.warn_explicit(w.message, w.category, where[0] if where else w.filename,
                                       where[1] if where else w.lineno, registry=_WARNED)
    return call


def _sync_method(what: str, applies: Callable[..., bool] | None = None, grad_warning: bool = False):
    def make(orig):
        plain = orig
        aside = _aside  # (torch's own update runs: see _aside)
        if grad_warning:
            orig = _warnings_at_caller(orig)

        # torch's code that calls this itself, not on the user's behalf: id -> code object (kept, so
        # that its id is not reused; an id, since hashing a code object hashes its contents)
        torch_own: dict[int, Any] = {}
        on_forget(torch_own.clear)  # (at the program's end: frames.forget_codes)

        def probe(self, *args, **kwargs):
            if _compiling() or aside[1] or not isinstance(self, torch.Tensor):  # (not a tensor: torch's own TypeError)
                return plain(self, *args, **kwargs)
            rec = REC
            if rec.active and not rec.in_data:
                f = sys._getframe(1)
                code = f.f_code
                if id(code) in torch_own:  # (one lookup: an optimizer's `step.item()` per parameter, every step)
                    return orig(self, *args, **kwargs)
                label: str | None = what
                if code.co_name in _DISPATCHERS:  # a mode passing on a call already seen (see _DISPATCHERS)
                    return orig(self, *args, **kwargs)
                if is_torch_internal(code.co_filename):  # torch calling itself: not the user's
                    # ...unless on the user's behalf
                    label = _INTERNAL_SYNCS.get(code) or _logging_sync(code.co_filename, what)
                    if label is None:
                        torch_own[id(code)] = code
                if label is not None:
                    with no_torch_function():  # (the auditor's reads: the user's modes see the call only)
                        dev = (None if applies is not None and not applies(self, *args, **kwargs)
                               else _internal_sync_device(f, self) if label in _INTERNAL_SYNCS_LABELS
                               else DEVICE_OF(self))
                    if dev is None or (JUDGE_AS_CUDA and dev != "cuda"):
                        return orig(self, *args, **kwargs)  # no sync here, or a host tensor: nothing to wait for
                    t0 = perf()
                    try:
                        return orig(self, *args, **kwargs)
                    finally:
                        rec.add(m.SYNC, label, user_frame(f), (perf() - t0) * 1e3, device=dev, **_via(f), **({} if _grad_on() else {"no_grad": True}))
            return orig(self, *args, **kwargs)
        return probe
    return make


def _to_host(self, *args, **kwargs) -> bool:
    """`t.to(...)` synchronises only when it copies a device tensor to the host."""
    if DEVICE_OF(self) == "cpu":
        return False
    dest = kwargs.get("device", args[0] if args else None)
    if isinstance(dest, torch.Tensor):
        dest = dest.device
    if isinstance(dest, (str, torch.device)):
        return torch.device(dest).type == "cpu"
    return False


def _single_element(self, *args, **kwargs) -> bool:
    return self.numel() == 1


def mask_index_sync(index: Any, frame: Any, call: Callable[[], Any], assigned: bool = False,
                    filled: bool = False) -> Any:
    """`call()`, the indexing `t[index]` (`t[index] = value`: assigned; of a host number: filled)
    made at `frame`, with the sync it makes recorded (probes.indexing.index_sync; the CUDA
    rehearsal's mode hands each indexing here)."""
    return index_sync(REC, DEVICE_OF, JUDGE_AS_CUDA, _DISPATCHERS, index, frame, call, assigned, filled)


def _install_sync_probes() -> None:
    _register_internal_syncs()
    T = torch.Tensor
    for name in ("item", "tolist", "numpy", "cpu", "nonzero", "masked_select"):
        _wrap(T, name, _sync_method(f"Tensor.{name}"))
    _wrap(T, "__bool__", _sync_method("bool(Tensor)", _single_element))
    _wrap(T, "__float__", _sync_method("float(Tensor)", grad_warning=True))
    _wrap(T, "__int__", _sync_method("int(Tensor)", grad_warning=True))
    _wrap(T, "__repr__", _sync_method("print/repr(Tensor)"))
    _wrap(T, "__format__", _sync_method("format(Tensor)", _single_element))
    _wrap(T, "to", _sync_method("Tensor.to(cpu)", _to_host))
    for name in ("nonzero", "masked_select"):
        _wrap(torch, name, _sync_function(f"torch.{name}"))
    _wrap(torch.cuda, "synchronize", _sync_function("torch.cuda.synchronize"))


# --- torch's own optimizer updates -------------------------------------------------------------

# A built-in optimizer's update reads each parameter's step counter with `.item()` (torch.optim's
# `_get_value`, of a host tensor: no sync), as many calls a step as the model has parameters, each
# looked at by its probe (its caller's frame, code and file) at ~0.5-1 us: 1-2% of a host-bound
# step. So while an update of torch's own code runs (its class's `step` is torch's, with no hook
# but ours around it), the Tensor methods' probes pass every call on at once; a closure it is given
# (LBFGS's, Lightning's) is the user's forward and backward, and runs probed. A flag the probes
# read, not the methods swapped back on the class: setting an attribute of torch.Tensor would
# invalidate what CPython cached of every Tensor attribute, at every site, twice a step. (The
# process's flag: a call another thread makes during the update is passed on too.)
_aside = [0, False]  # [updates begun and not ended (nested ones counted), whether the probes pass calls on]
_TORCH_STEP: dict[type, bool] = {}  # optimizer class -> its step is torch's own code
_MINE = object()  # (_torch_update: a step whose code is not all torch's)
_OURS_ONLY: dict[tuple, bool] = {}  # the ids of torch's global optimizer hooks -> they are all the auditor's


def _torch_update(opt: Any, args: tuple, kwargs: dict) -> Any:
    """_MINE where the user's code may run inside this optimizer step outside a closure (see
    _aside); else its closure, or None."""
    cls = type(opt)
    own = _TORCH_STEP.get(cls)
    if own is None:
        try:
            code = getattr(inspect.unwrap(cls.step), "__code__", None)  # (torch wraps step to run the hooks)
        except (AttributeError, ValueError):  # (no step of its own to read, or wrappers in a cycle)
            code = None
        own = _TORCH_STEP[cls] = code is not None and is_torch_internal(code.co_filename)
    if not own or len(args) > 2 or any(k != "closure" for k in kwargs):
        return _MINE
    if getattr(opt, "_optimizer_step_pre_hooks", None) or getattr(opt, "_optimizer_step_post_hooks", None):
        return _MINE
    pre, post = _optimizer._global_optimizer_pre_hooks, _optimizer._global_optimizer_post_hooks
    key = (*pre, None, *post)  # (the hooks' ids: a hook registered since has a new one)
    ours = _OURS_ONLY.get(key)
    if ours is None:
        ours = _OURS_ONLY[key] = all(getattr(h, "__module__", "").startswith("auditor.")
                                     for h in chain(pre.values(), post.values()))
    if not ours:
        return _MINE
    closure = kwargs["closure"] if "closure" in kwargs else args[1] if len(args) > 1 else None
    return closure if callable(closure) else None


def update_begins(opt: Any, args: tuple, kwargs: dict) -> tuple | None:
    """An optimizer step's pre-hooks are done (called by the last of ours): see _aside. Returns the
    step's arguments with its closure made to run probed, where it has one."""
    depth = _aside[0]
    _aside[0] = depth + 1
    if depth == 0:
        closure = _torch_update(opt, args, kwargs)
        if closure is not _MINE:
            _aside[1] = True
            if closure is not None:
                probed = _probed(closure)
                if "closure" in kwargs:
                    return args, {**kwargs, "closure": probed}
                return (args[0], probed, *args[2:]), kwargs
    elif _aside[1] and _torch_update(opt, args, kwargs) is not None:  # (the user's code, in torch's update)
        _aside[1] = False
    return None


def update_ends() -> None:
    """An optimizer step has returned (called by the first of our post-hooks)."""
    if _aside[0]:
        _aside[0] -= 1
    if _aside[0] == 0:
        _aside[1] = False


def _probed(closure: Callable) -> Callable:
    """`closure`, run with the probes looking (the user's forward and backward, inside an update)."""
    def closure_probed():
        aside, _aside[1] = _aside[1], False
        try:
            return closure()
        finally:
            _aside[1] = aside and _aside[0] > 0  # (still inside the update)
    return closure_probed


def _sync_function(what: str):
    def make(orig):
        def probe(*args, **kwargs):
            if _compiling() or _aside[1]:
                return orig(*args, **kwargs)
            rec = REC
            if rec.active and not rec.in_data:
                f = _user_call()
                if f is not None:
                    first = args[0] if args else None
                    with no_torch_function():  # (the auditor's read: the user's modes see the call only)
                        dev = "cuda" if what.startswith("torch.cuda") else DEVICE_OF(first)
                    if JUDGE_AS_CUDA and dev != "cuda":
                        return orig(*args, **kwargs)
                    t0 = perf()
                    try:
                        return orig(*args, **kwargs)
                    finally:
                        rec.add(m.SYNC, what, user_frame(f), (perf() - t0) * 1e3, device=dev, **_via(f), **({} if _grad_on() else {"no_grad": True}))
            return orig(*args, **kwargs)
        return probe
    return make


# --- timed calls: cleanup, stat resets ---------------------------------------------------------

def _timed_function(kind: str, what: str, data: Callable[..., dict] | None = None):
    """A probe that times the user's calls of a function and tallies them at their line; `data`,
    given the call's arguments, adds what the tally keeps of them (torch.save: the file)."""
    def make(orig):
        def probe(*args, **kwargs):
            if _compiling():
                return orig(*args, **kwargs)
            rec = REC
            if rec.active:
                f = _user_call()
                if f is not None:
                    t0 = perf()
                    try:
                        return orig(*args, **kwargs)
                    finally:
                        rec.add(kind, what, user_frame(f), (perf() - t0) * 1e3,
                                **(data(*args, **kwargs) if data else {}), **_via(f))
            return orig(*args, **kwargs)
        return probe
    return make


def _install_timed_probes() -> None:
    for name in ("reset_peak_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached",
                 "reset_accumulated_memory_stats"):
        if hasattr(torch.cuda, name):
            _wrap(torch.cuda, name, _timed_function(m.STAT_RESET, f"torch.cuda.{name}"))
    _wrap(torch.cuda, "empty_cache", _timed_function(m.EMPTY_CACHE, "torch.cuda.empty_cache"))
    # torch.accelerator's device-generic twins (PyTorch's own examples call these now)
    acc = getattr(torch, "accelerator", None)
    for name in ("reset_peak_memory_stats", "reset_accumulated_memory_stats"):
        if acc is not None and hasattr(acc, name):
            _wrap(acc, name, _timed_function(m.STAT_RESET, f"torch.accelerator.{name}"))
    if acc is not None and hasattr(acc, "empty_cache"):
        _wrap(acc, "empty_cache", _timed_function(m.EMPTY_CACHE, "torch.accelerator.empty_cache"))
    _wrap(gc, "collect", _timed_function(m.GC_COLLECT, "gc.collect"))
    _wrap(torch, "save", _timed_function(m.SAVE, "torch.save", _saved_file))


def _saved_file(obj: Any = None, f: Any = None, *args: Any, **kwargs: Any) -> dict:
    """torch.save's file: a checkpoint saved once the weights are NaN is poisoned, and nonfinite
    names it and the last one saved before (None for a buffer or an open file object)."""
    path = os.fspath(f) if isinstance(f, (str, os.PathLike)) else None
    return {"path": os.path.abspath(path) if isinstance(path, str) else None}


# --- anomaly mode ------------------------------------------------------------------------------

_anomaly_enabled = torch.is_anomaly_enabled


def _install_anomaly_probe() -> None:
    def make(orig):
        def probe(enabled, *args, **kwargs):
            out = orig(enabled, *args, **kwargs)  # (torch judges the arguments first: a bad one raises its error)
            rec = REC
            if torch.is_anomaly_enabled() and rec.active and not _compiling():
                rec.add(m.ANOMALY_ON, "anomaly detection", user_frame(sys._getframe(1)))
            return out
        return probe
    _wrap(torch, "set_anomaly_enabled", make)


# --- backward, retain_graph --------------------------------------------------------------------

def _watch_retained(rec: Recorder, roots: list[Any], what: str, where: FrameKey) -> None:
    """Hook every node of a retained graph: if no later backward runs through it before the step
    ends, the graph was kept alive for nothing."""
    n = rec.retain_sampled.get(where, 0)
    rec.retain_sampled[where] = n + 1
    nodes, saved, read_all = graph_of(roots, measure=n < 3)
    used = [False]
    alive = _watch_lifetime(rec, roots, where)

    def hook(*_: Any) -> None:
        used[0] = True

    for node in nodes:
        if type(node).__name__ == "AccumulateGrad":
            continue  # shared by every graph over the same parameters: says nothing about reuse
        try:
            node.register_prehook(hook)
        except (RuntimeError, AttributeError):
            pass
    rec.retain_events.append({"what": what, "where": where, "used": used, "nodes": len(nodes), "saved_bytes": saved,
                              "saved_partial": not read_all, "alive": alive})


class _Lifetime:
    """Kept in a graph's root node (its `metadata` dict): freed with the graph, when the loss that
    held it is dropped or reassigned. Counting these tells how many retained graphs, and so how
    many copies of their saved activations, were alive at once."""

    __slots__ = ("__weakref__",)


def _watch_lifetime(rec: Recorder, roots: list[Any], where: FrameKey) -> int | None:
    """Count this retained graph alive at `where` until its root node is freed; return how many
    graphs retained there are alive now (None when the node takes no metadata)."""
    root = next((r for r in roots if r is not None), None)
    if root is None:
        return None
    token = _Lifetime()
    try:
        root.metadata["auditor.retained"] = token
    except (AttributeError, RuntimeError, TypeError):
        return None
    live = rec.retain_alive
    live[where] = live.get(where, 0) + 1
    weakref.finalize(token, _graph_freed, live, where)
    return live[where]


def _graph_freed(live: dict, where: FrameKey) -> None:
    live[where] = live.get(where, 1) - 1


def _roots(tensors: Any) -> list[Any]:
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    return [t.grad_fn for t in tensors if isinstance(t, torch.Tensor)]


def _backward_probe(what: str, tensors_of: Callable[..., Any]):
    def make(orig):
        def probe(*args, **kwargs):
            if _compiling():
                return orig(*args, **kwargs)
            rec = REC
            if rec.active:
                f = _user_call()
                if f is not None:
                    settle_traced_steps()  # (before this backward pass changes their gradients)
                    for start in _BACKWARD_STARTS:
                        start(what, tensors_of(*args, **kwargs))
                    for read in _BACKWARD_READERS:
                        read(args, kwargs)
                    where = user_frame(f)
                    retain = kwargs.get("retain_graph")
                    if retain is None:
                        retain = kwargs.get("create_graph", False)
                    anomaly = _anomaly_enabled()  # (a flag read: the only cost on this path)
                    t0 = perf()
                    result = orig(*args, **kwargs)
                    rec.add(m.BACKWARD, what, where, (perf() - t0) * 1e3, retain_graph=bool(retain))
                    if anomaly:
                        rec.add(m.ANOMALY_ON, m.ANOMALY_BACKWARD, where)
                    if retain:
                        _watch_retained(rec, _roots(tensors_of(*args, **kwargs)), what, where)
                    return result
            return orig(*args, **kwargs)
        return probe
    return make


_BACKWARD_READERS: list[Callable[[tuple, dict], None]] = []


def read_backward_calls(reader: Callable[[tuple, dict], None]) -> None:
    """Have `reader(args, kwargs)` called with the arguments of each backward pass the user's code
    starts (`loss.backward()`, `torch.autograd.backward`, `torch.autograd.grad`) outside compiled
    code, before it runs."""
    _BACKWARD_READERS.append(reader)


_BACKWARD_STARTS: list[Callable[[str], None]] = []


def on_backward_start(reader: Callable[[str, Any], None]) -> Callable[[], None]:
    """Have `reader(what, tensors)` called as each backward pass the user's code starts outside compiled
    code begins ("Tensor.backward", "torch.autograd.backward", "torch.autograd.grad"; `tensors`: what
    it differentiates, a tensor or a sequence of them, as passed), before the
    probe times it: a step boundary crossed there puts the pass in the new step. (A wrapper of
    its own around backward would be the probe's caller, which the probe takes for torch's or
    the auditor's own call, and leaves untallied.) Returns the undo."""
    _BACKWARD_STARTS.append(reader)
    return lambda: _BACKWARD_STARTS.remove(reader) if reader in _BACKWARD_STARTS else None


def _install_backward_probes() -> None:
    first = lambda *a, **k: a[0] if a else next(iter(k.values()), None)  # noqa: E731
    _wrap(torch.Tensor, "backward", _backward_probe("Tensor.backward", first))
    _wrap(torch.autograd, "backward", _backward_probe(
        "torch.autograd.backward", lambda *a, **k: a[0] if a else k.get("tensors")))
    _wrap(torch.autograd, "grad", _backward_probe(
        "torch.autograd.grad", lambda *a, **k: a[0] if a else k.get("outputs")))


# --- forward and optimizer phases --------------------------------------------------------------

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


# Optimizer steps that ran inside code torch.compile traced, noted by the traced step pre-hook
_TRACED_STEPS = TracedCalls()
_TRACED_STEP_READERS: list[Callable[[Any, FrameKey], None]] = []


def traced_optimizer_step(opt: Any) -> None:
    """What the optimizer pre-hooks do when torch.compile traces them (`torch.compiler.is_compiling()`):
    note the step, as a store dynamo replays after the graph, for `settle_traced_steps` to read
    once the compiled code has run (see unseen.TracedCalls). Run as they are, the hooks would be a
    graph break in the user's compiled step, and an error under `fullgraph=True`."""
    _TRACED_STEPS.note(opt)


def read_traced_steps(reader: Callable[[Any, FrameKey], None]) -> None:
    """Have `reader(optimizer, where)` called with each optimizer step `settle_traced_steps` reads."""
    _TRACED_STEP_READERS.append(reader)


def unread_traced_steps(reader: Callable[[Any, FrameKey], None]) -> None:
    if reader in _TRACED_STEP_READERS:
        _TRACED_STEP_READERS.remove(reader)


def settle_traced_steps() -> None:
    """The optimizer steps that ran in compiled code since the last call, counted as optimizer
    phases of the user's line that called the compiled code, with no time (the hooks that time a
    step cannot run inside a graph), and handed to the readers. Called wherever the auditor runs
    next and the step's inputs may change: before the next optimizer step, zero_grad, a backward
    pass or a scheduler's step, and at the step's end."""
    if _compiling():  # (read by the code that runs after the compiled code)
        return
    for opt, where in _TRACED_STEPS.take():
        rec = REC
        if rec is not None and rec.active:
            rec.add(m.OPTIMIZER, type(opt).__name__, where, 0.0, compiled=True)
        for reader in _TRACED_STEP_READERS:
            reader(opt, where)


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


def install() -> Recorder:
    """Install every probe (idempotent) and return the process's recorder."""
    global REC
    if REC is None:
        REC = Recorder()
        from auditor.capture.bench_switches import OFF, TOGGLED

        _part_on[1] = bool(TOGGLED)  # (bench_steady_parts.py --toggle only: the part's wrappers kept, to swap)
        if "probes" not in OFF:  # (bench_steady_parts.py only)
            _install_sync_probes()
            _install_timed_probes()
            _install_anomaly_probe()
        _part_on[1] = False
        _install_backward_probes()
        if not saved_tensors.PACKED_FORM:  # (torch 2.4: a graph's saved tensors read only before any hooks)
            _wrap(torch.autograd.graph.saved_tensors_hooks, "__enter__", saved_tensors.noting_entered)
        _part_on[1] = bool(TOGGLED)
        if "probes" not in OFF:
            from auditor.capture.probes.hook_probes import install_hook_probes

            install_hook_probes(_wrap, lambda: REC, lambda: _user_call(3))
        _part_on[1] = False
        _install_phase_hooks()
        from auditor.capture.probes.data import install_dataloader_probes, install_sampler_probes

        install_dataloader_probes(REC, _wrap)
        from auditor.capture.probes import workers

        os.register_at_fork(after_in_child=functools.partial(workers.forked, _WRAPPED))
        install_sampler_probes(REC, _wrap)
    return REC
