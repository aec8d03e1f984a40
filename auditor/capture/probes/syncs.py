"""Device->host synchronisations: the Tensor methods and torch functions that wait for the device
(`.item()`, `.cpu()`, `bool(t)`, `torch.cuda.synchronize`...), tallied at the user's line with the
time they took, and the device they waited for as the rules judge it."""
from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Callable

import torch

from auditor.capture.frames import is_torch_internal, on_forget, user_frame
from auditor.capture.frames import via_data as _via
from auditor.capture.probes.indexing import index_sync
from auditor.capture.probes.optimizer_updates import _aside
from auditor.capture.probes.recorder import REC
from auditor.capture.probes.wrappers import _DISPATCHERS, _compiling, _grad_on, _user_call, _wrap, perf
from auditor.capture.unseen import no_torch_function, recorded_warnings
from auditor.evidence import model as m


def _device_type(t: Any) -> str:
    return t.device.type if isinstance(t, torch.Tensor) else "cpu"


# Where a tensor lives, as the rules should judge it. CUDA rehearsal (auditor.capture.rehearsal)
# replaces this before install() so tensors the program meant for the GPU count as "cuda".
DEVICE_OF: Callable[[Any], str] = _device_type
# True when only syncs on "cuda" tensors count (a real GPU, or a rehearsal of one).
JUDGE_AS_CUDA: bool = torch.cuda.is_available()


def judged_as_gpu_code() -> bool:
    """Whether the probes judge this run as GPU code (a real CUDA device, or a rehearsal)."""
    return JUDGE_AS_CUDA


def judge_as_gpu_code(device_of: Callable[[Any], str]) -> None:
    """CUDA rehearsal, before install(): tensors are judged by `device_of` (those the program meant
    for the GPU count as "cuda"), and only syncs on "cuda" tensors count."""
    global DEVICE_OF, JUDGE_AS_CUDA
    DEVICE_OF, JUDGE_AS_CUDA = device_of, True


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
            # (the flag first: torch's own update makes most of these calls, `step.item()` once per
            # parameter, and passed on without arguments to unpack each costs half as much)
            if aside[1]:
                return plain(self, *args, **kwargs) if args or kwargs else plain(self)
            if _compiling() or not isinstance(self, torch.Tensor):  # (not a tensor: torch's own TypeError)
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
