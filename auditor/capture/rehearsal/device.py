"""CUDA rehearsal, the tensor side: run every device request on the CPU, remember what was meant for the GPU.

A `TorchFunctionMode` rewrites device requests for `cuda` (a `device=` argument, `.to(...)`,
`.cuda()`, a factory under a default device of `cuda`) to the CPU, so the program computes exactly
what its CPU version computes, and marks the tensors meant for the GPU with a Python attribute that
passes to the results of every call with a marked input. `device_of(t)` answers "cuda" for a marked
tensor (installed as `probes.DEVICE_OF`). Marks, not fake device tensors: an attribute changes no
kernel and no result, and it is kept out of pickles.

Recorded as probe tallies: `h2d-copy` (a host->device copy: bytes, pinned, non_blocking),
`data-device-op` (a GPU tensor made while DataLoader iteration runs) and `device-batch` (a batch
already on the GPU, recorded by rehearsal.data).
Refused with the GPU's own error, though the CPU would run it: GPU and host tensors mixed in one of
the user's calls or at a torch.nn layer (`_check_devices`, `_leaf_inputs_on_host`), `.numpy()` of a
GPU tensor, a generator of the other device (`_check_generator`).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from types import FrameType, FunctionType
from typing import Any, Callable

import torch
import torch.utils._device as _device_ctx
from torch.overrides import TorchFunctionMode

import auditor
from auditor.capture import own_time, probes, torch_private, unseen
from auditor.capture.rehearsal import clock
from auditor.capture.rehearsal.call_sites import call_site
from auditor.capture.frames import is_torch_internal
from auditor.evidence import model as m

CUDA_MARK = "_auditor_cuda"  # the program meant this tensor for the GPU
PINNED_MARK = "_auditor_pinned"  # the program pinned it (pin_memory() / DataLoader(pin_memory=True))
LOADER_MARK = "_auditor_loader"  # id of the DataLoader whose batch held this tensor
PARAM_OF = "_auditor_param_of"  # a parameter's `.data` alias: the parameter (see rehearsal.ops)
MARKS = (CUDA_MARK, PINNED_MARK, LOADER_MARK, PARAM_OF)

CPU = torch.device("cpu")
REHEARSED_DEVICE = torch.device("cuda", 0)  # what user code is told a marked tensor's device is
# What torch's own code is told a marked tensor's device is: the CPU, where the tensor is, so torch
# keeps its CPU paths; but this one object, so that what torch then puts on "that tensor's device"
# (clip_grad_norm_'s `norm.to(grads[0].device)`, a factory's `device=p.device`) is known to be on
# the GPU, as it is there. Told the plain CPU, the norm clip_grad_norm_ returns would be a host
# tensor, and the user's `norm.item()` no sync.
DEVICE_OF_GPU_TENSOR = torch.device("cpu")
_T = torch._C.TensorBase

_AUDITOR_DIR = os.path.normcase(os.path.realpath(os.path.dirname(auditor.__file__))) + os.sep
_auditor_files: dict[str, bool] = {}
# Frames of the auditor that only pass a call through (other modes, probe wrappers): skipped when
# deciding whether the user's code made a call.
_PASS_THROUGH = frozenset({"__torch_function__", "probe", "standin"})
# `torch.set_default_device`'s mode passes every call on too: from torch 2.5 it sits at the bottom
# of the mode stack, below the rehearsal's; before, it sits above it, and a call the user's code
# makes under it reaches the rehearsal from this method.
_DEVICE_CONTEXT_CALL = _device_ctx.DeviceContext.__torch_function__.__code__


# --- marks ---------------------------------------------------------------------------------------

def is_marked(t: Any) -> bool:
    """Whether `t` is a tensor the program meant for the GPU."""
    return isinstance(t, torch.Tensor) and getattr(t, CUDA_MARK, False)


# Called with each tensor as it is marked while the program records a memory history
# (auditor.capture.rehearsal.memory); None otherwise.
ON_MARK: Callable[[torch.Tensor], None] | None = None


def mark(t: torch.Tensor) -> None:
    if not getattr(t, CUDA_MARK, False):
        setattr(t, CUDA_MARK, True)
        if ON_MARK is not None:
            ON_MARK(t)


def unmark(t: torch.Tensor) -> None:
    t.__dict__.pop(CUDA_MARK, None)


def is_pinned(t: torch.Tensor) -> bool:
    return getattr(t, PINNED_MARK, False)


def device_of(x: Any) -> str:
    """Device type as the rules should judge it: "cuda" for tensors meant for the GPU."""
    if not isinstance(x, torch.Tensor):
        return "cpu"
    return "cuda" if getattr(x, CUDA_MARK, False) else x.device.type


def is_cuda_request(dev: Any) -> bool:
    """A device argument naming CUDA: "cuda", "cuda:1", torch.device("cuda"), or an int (= cuda:N)."""
    if isinstance(dev, torch.device):
        return dev.type == "cuda" or dev is DEVICE_OF_GPU_TENSOR
    if isinstance(dev, str):
        return dev.strip().split(":", 1)[0] == "cuda"
    return isinstance(dev, int) and not isinstance(dev, bool)


def default_is_cuda() -> bool:
    """Whether `torch.set_default_device("cuda")` or `with torch.device("cuda"):` is in force."""
    d = _device_ctx.CURRENT_DEVICE
    return d is not None and d.type == "cuda"


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _is_auditor(filename: str) -> bool:
    v = _auditor_files.get(filename)
    if v is None:
        v = _auditor_files[filename] = os.path.normcase(os.path.realpath(filename)).startswith(_AUDITOR_DIR)
    return v


_HANDLE_TORCH_FUNCTION = torch.overrides.handle_torch_function.__code__


def caller_is_user(frame: FrameType | None) -> bool:
    """Whether the call was made by the user's code (or a third-party library), not by torch or
    the auditor: only those are told the rehearsed answers (`.device` is cuda, `is_available()`),
    so torch itself keeps taking its CPU code paths and computes what the CPU run computes."""
    f = frame
    while f is not None:  # up to the call's caller, past what only passes the call on:
        if f.f_code is _HANDLE_TORCH_FUNCTION:  # a Python-level torch function (F.cross_entropy)
            f = f.f_back.f_back if f.f_back is not None else None
        elif f.f_code.co_name in _PASS_THROUGH and _is_auditor(f.f_code.co_filename):
            f = f.f_back  # another mode above this one, a probe's wrapper
        elif f.f_code is _DEVICE_CONTEXT_CALL:
            f = f.f_back
        else:
            break
    return f is not None and not is_torch_internal(f.f_code.co_filename)


def _tensors(x: Any, depth: int = 2):
    if isinstance(x, torch.Tensor):
        yield x
    elif depth and isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v, depth - 1)


def _args_marked(args: tuple) -> bool:
    """Whether any tensor argument is meant for the GPU. Of a list (torch.stack, torch.cat) only
    the ends are looked at: a GPU op's list lives on one device, and scanning a 512-sample stack
    per batch would cost more than the rest of the rehearsal."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if getattr(a, CUDA_MARK, False):
                return True
        elif isinstance(a, (list, tuple)) and a:
            if getattr(a[0], CUDA_MARK, False) is True or getattr(a[-1], CUDA_MARK, False) is True:
                return True
    return False


_NO_KWARGS: dict = {}

# Calls that take a host tensor next to a GPU one by design: indexing with host indices, uses of a
# tensor's shape or type only, copies and pickling.
_CROSS_DEVICE_OK = frozenset({
    "__getitem__", "__setitem__", "index_put_", "index_put", "_index_put_impl_", "expand_as", "view_as",
    "reshape_as", "type_as", "new_tensor", "is_set_to", "set_", "__deepcopy__", "__reduce_ex__", "__setstate__",
    "__format__", "__repr__", "__str__", "copy_", "to", "cuda", "cpu",
    "ctc_loss",  # its input and target lengths may stay on the host (cuDNN's CTC even wants them there)
    "tensor_split",  # its indices tensor must be on the host
})


def _host_operand(args: Any) -> torch.Tensor | None:
    """A host tensor with dimensions among the arguments (of a list, its ends, as `_args_marked`).
    A 0-dim host tensor is not one: a GPU kernel takes it as a scalar."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if not getattr(a, CUDA_MARK, False) and a.dim() > 0:
                return a
        elif isinstance(a, (list, tuple)) and a:
            for v in (a[0], a[-1]):
                if isinstance(v, torch.Tensor) and not getattr(v, CUDA_MARK, False) and v.dim() > 0:
                    return v
    return None


def refuse_mixed_devices(what: str) -> None:
    raise RuntimeError(
        "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu! "
        f"(CUDA rehearsal: {what} got a GPU tensor and a CPU tensor, which a GPU refuses; "
        "move the CPU one with .to(device))")


def _check_devices(func: Callable, args: tuple, kwargs: dict, frame: FrameType | None) -> None:
    """A call from the user's code that mixes GPU tensors with host tensors fails on a GPU (a model
    on the GPU fed labels left on the CPU): refuse it as the GPU would. torch's own calls are
    left alone: inside torch, `.device` reads the CPU, so its helper tensors carry no mark."""
    host = _host_operand(args) if args else None
    if host is None and kwargs:
        host = _host_operand(tuple(kwargs.values()))
    if host is None or getattr(func, "__name__", "") in _CROSS_DEVICE_OK or not caller_is_user(frame):
        return
    refuse_mixed_devices(_op_label(func))


def _leaf_inputs_on_host(module: torch.nn.Module, args: tuple) -> None:
    """Forward pre-hook: a torch.nn layer whose weights and inputs are on different devices (the
    model moved to the GPU and its input not, or the other way round; a loss given GPU logits and
    host labels) fails at its first op on a GPU, whoever calls it (the user, or nn.Sequential).
    torch's own calls are not checked one by one (see `_check_devices`), so the layer is checked
    at its call."""
    if module._modules or not type(module).__module__.startswith("torch.nn."):
        return
    tensors = [p for p in module._parameters.values() if p is not None]
    n_params = len(tensors)
    # the input (and a loss's target): later arguments may be host data by design (CTCLoss's lengths)
    tensors += [a for a in args[:2] if isinstance(a, torch.Tensor)]
    marked = [bool(getattr(t, CUDA_MARK, False)) for t in tensors]
    if any(marked) and any(not m and t.dim() > 0 for t, m in zip(tensors, marked)):
        where = "its weights are on the GPU" if any(marked[:n_params]) else "its inputs are on the GPU"
        refuse_mixed_devices(f"{type(module).__name__} ({where})")


def _op_label(func: Callable) -> str:
    name = getattr(func, "__name__", "a call")
    qual = getattr(func, "__qualname__", name)
    return f"Tensor.{name}" if qual.split(".")[0] in ("TensorBase", "Tensor") else f"torch.{name}"


def _mark_results(out: Any, args: tuple, kwargs: dict) -> None:
    """Mark the tensors a call produced; tensors it only returned back (in-place ops, `out=`) keep
    the device they had."""
    for t in _tensors(out):
        if not getattr(t, CUDA_MARK, False) and not any(t is a for a in args) and t is not kwargs.get("out"):
            setattr(t, CUDA_MARK, True)
            if ON_MARK is not None:
                ON_MARK(t)


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A new tensor object sharing `t`'s memory: what `.cuda()`/`.cpu()` hand back as "the copy"
    when the rehearsal stays on the CPU, so marking the result leaves the source as it was.
    A tensor that requires grad is returned itself for `.cuda()` (see `_moved`), so leaves stay
    leaves exactly as in the CPU run."""
    return t.detach() if not t.requires_grad else t.view_as(t)


# --- recording -----------------------------------------------------------------------------------

def _record(kind: str, what: str, frame: FrameType | None, **data: Any) -> None:
    rec = probes.REC
    if rec is not None and rec.active:
        rec.add(kind, what, call_site(frame), 0.0, **data)


def _copy_to_device(src: torch.Tensor, non_blocking: bool, what: str, frame: FrameType | None) -> None:
    """A host->device copy the program asked for: recorded for pageable-copy, or for
    dataloader-on-device when it happens while a batch is being made."""
    rec = probes.REC
    if rec is None or not rec.active:
        return
    if rec.in_data:
        rec.add(m.DATA_DEVICE_OP, what, call_site(frame), 0.0)
        return
    rec.add(m.H2D_COPY, what, call_site(frame), 0.0, bytes=_bytes(src), pinned=bool(is_pinned(src)),
            non_blocking=bool(non_blocking), loader=getattr(src, LOADER_MARK, None))


# --- calls with their own handling ---------------------------------------------------------------

Handler = Callable[[Callable, tuple, dict, FrameType | None], Any]


def _moved(src: torch.Tensor, out: Any, target: str | None, non_blocking: bool, what: str,
           frame: FrameType | None, torch_own: bool = False) -> Any:
    """The result of a device move (`.to`, `.cuda`, `.cpu`), marked as the GPU would place it.
    `torch_own`: torch's own move to a GPU tensor's device (see DEVICE_OF_GPU_TENSOR), not a
    copy the program asked for."""
    if not isinstance(out, torch.Tensor):
        return out
    src_marked = getattr(src, CUDA_MARK, False)
    if target == "cuda":
        if src_marked:
            if out is not src:  # a dtype conversion on the device
                mark(out)
            return out
        if not torch_own:
            _copy_to_device(src, non_blocking, what, frame)
        if out is src and not src.requires_grad:
            out = _alias(src)
        mark(out)
        return out
    if target == "cpu":
        if src_marked:  # device -> host: the result lives on the host
            if out is src:
                out = _alias(src)
            unmark(out)
        return out
    if src_marked and out is not src:  # no device change (dtype, memory format)
        mark(out)
    return out


def _to(func: Callable, args: tuple, kwargs: dict, frame: FrameType | None) -> Any:
    """Tensor.to(device, dtype, non_blocking, copy) / to(dtype, ...) / to(other, ...)."""
    src, rest, kw = args[0], list(args[1:]), dict(kwargs)
    target: str | None = None
    nb_pos = None
    dev = kw.get("device")
    torch_own = dev is DEVICE_OF_GPU_TENSOR or bool(rest) and rest[0] is DEVICE_OF_GPU_TENSOR
    if dev is not None:
        target = _target(dev)
        if target == "cuda":
            kw["device"] = CPU
        nb_pos = 1 if rest and isinstance(rest[0], torch.dtype) else None
    elif rest:
        first = rest[0]
        if isinstance(first, torch.Tensor):
            target, nb_pos = ("cuda" if getattr(first, CUDA_MARK, False) else first.device.type), 1
        elif isinstance(first, torch.dtype):
            nb_pos = 1
        else:  # a device (or None) first: to(device, dtype, non_blocking, copy)
            nb_pos = 2
            if first is not None:
                target = _target(first)
                if target == "cuda":
                    rest[0] = CPU
    non_blocking = kw.get("non_blocking", rest[nb_pos] if nb_pos is not None and len(rest) > nb_pos else False)
    out = func(src, *rest, **kw)
    return _moved(src, out, target, bool(non_blocking), "Tensor.to(cuda)", frame, torch_own)


def _target(dev: Any) -> str | None:
    """"cuda", "cpu", or None for other devices (meta, ...), which the rehearsal leaves alone."""
    if is_cuda_request(dev):
        return "cuda"
    try:
        return "cpu" if torch.device(dev).type == "cpu" else None
    except (RuntimeError, TypeError):
        return None


def _cuda(func: Callable, args: tuple, kwargs: dict, frame: FrameType | None) -> Any:
    """Tensor.cuda(device=None, non_blocking=False, memory_format=...): stays on the CPU."""
    src = args[0]
    non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
    fmt = kwargs.get("memory_format")
    out = _T.to(src, CPU, memory_format=fmt) if fmt is not None else src
    return _moved(src, out, "cuda", bool(non_blocking), "Tensor.cuda", frame)


def _cpu(func: Callable, args: tuple, kwargs: dict, frame: FrameType | None) -> Any:
    return _moved(args[0], func(*args, **kwargs), "cpu", False, "Tensor.cpu", frame)


def _type(func: Callable, args: tuple, kwargs: dict, frame: FrameType | None) -> Any:
    """Tensor.type(dtype=None, non_blocking=False): the legacy spelling of a move. A CUDA type
    ("torch.cuda.FloatTensor", or the class itself) moves to the device; a CPU type moves a GPU
    tensor back; with no type, a GPU tensor names its CUDA type, as it would on the GPU."""
    src = args[0]
    rest, kw = list(args[1:]), dict(kwargs)
    dtype = kw.get("dtype", rest[0] if rest else None)
    if dtype is None:
        name = func(*args, **kwargs)
        if isinstance(name, str) and getattr(src, CUDA_MARK, False) and name.startswith("torch."):
            return "torch.cuda." + name[len("torch."):]
        return name
    spelled = dtype if isinstance(dtype, str) else (
        f"{dtype.__module__}.{dtype.__name__}" if isinstance(dtype, type) else "")
    if not spelled.startswith("torch."):  # a torch.dtype (no move), or what torch rejects itself
        return _moved(src, func(*args, **kwargs), None, False, "Tensor.type", frame)
    cuda = spelled.startswith("torch.cuda.")
    host = "torch." + spelled[len("torch.cuda."):] if cuda else spelled
    if "dtype" in kw:
        kw["dtype"] = host
    else:
        rest[0] = host
    non_blocking = kw.get("non_blocking", rest[1] if len(rest) > 1 else False)
    out = func(src, *rest, **kw)
    return _moved(src, out, "cuda" if cuda else "cpu", bool(non_blocking), "Tensor.type(cuda)", frame)


def _copy_(func: Callable, args: tuple, kwargs: dict, frame: FrameType | None) -> Any:
    """dst.copy_(src): a host->device copy when dst is on the GPU and src is not."""
    dst, src = args[0], args[1] if len(args) > 1 else kwargs.get("src")
    if getattr(dst, CUDA_MARK, False) and isinstance(src, torch.Tensor) and not getattr(src, CUDA_MARK, False):
        nb = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
        _copy_to_device(src, bool(nb), "Tensor.copy_(host->cuda)", frame)
    return func(*args, **kwargs)


def _pin_memory(func: Callable, args: tuple, kwargs: dict, frame: FrameType | None) -> Any:
    """Tensor.pin_memory(): a CPU-only torch cannot pin, so the copy is an ordinary one, remembered
    as pinned. Pinning a GPU tensor fails as it does on a GPU."""
    src = args[0]
    if getattr(src, CUDA_MARK, False):
        raise RuntimeError(f"cannot pin '{src.type().replace('torch.', 'torch.cuda.')}' only dense CPU "
                           "tensors can be pinned")
    if is_pinned(src):
        return src
    out = src.clone()
    setattr(out, PINNED_MARK, True)
    return out


def _is_pinned(func: Callable, args: tuple, kwargs: dict, frame: FrameType | None) -> bool:
    return bool(is_pinned(args[0]))


def _no_op(func: Callable, args: tuple, kwargs: dict, frame: FrameType | None) -> None:
    return None  # Tensor.record_stream: one stream here


def _parse_to(func: Callable, args: tuple, kwargs: dict, frame: FrameType | None) -> Any:
    """`Module.to(...)` parses its arguments with torch._C._nn._parse_to, then moves each tensor
    with `t.to(device, ...)`: the device must come back as asked (cuda), so that those moves are
    rewritten and marked (`_to`); rewritten here, `model.to(device="cuda")` moved nothing. A device
    index (`model.to(torch.cuda.current_device())`) names the CUDA device, as on a GPU machine."""
    if args and isinstance(args[0], int) and not isinstance(args[0], bool):
        args = (torch.device("cuda", args[0]), *args[1:])
    elif isinstance(kwargs.get("device"), int) and not isinstance(kwargs["device"], bool):
        kwargs = {**kwargs, "device": torch.device("cuda", kwargs["device"])}
    return func(*args, **kwargs)


def _device_get(func: Callable, args: tuple, kwargs: dict, frame: FrameType | None) -> Any:
    if getattr(args[0], CUDA_MARK, False):
        return REHEARSED_DEVICE if caller_is_user(frame) else DEVICE_OF_GPU_TENSOR
    return func(*args, **kwargs)


def _is_cuda_get(func: Callable, args: tuple, kwargs: dict, frame: FrameType | None) -> Any:
    return True if getattr(args[0], CUDA_MARK, False) and caller_is_user(frame) else func(*args, **kwargs)


def _get_device(func: Callable, args: tuple, kwargs: dict, frame: FrameType | None) -> Any:
    user = getattr(args[0], CUDA_MARK, False) and caller_is_user(frame)
    return REHEARSED_DEVICE.index if user else func(*args, **kwargs)


def _numpy(func: Callable, args: tuple, kwargs: dict, frame: FrameType | None) -> Any:
    if getattr(args[0], CUDA_MARK, False) and caller_is_user(frame):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
                        "host memory first. (CUDA rehearsal: a GPU tensor fails here on a GPU)")
    return func(*args, **kwargs)


def _data_set(func: Callable, args: tuple, kwargs: dict, frame: FrameType | None) -> Any:
    """`p.data = t`: p now lives where t lives."""
    out = func(*args, **kwargs)
    dst, value = args[0], args[1]
    (mark if is_marked(value) else unmark)(dst)
    return out


def _marked_call(func: Callable, args: tuple, kwargs: dict, frame: FrameType | None, clocked: bool = False) -> Any:
    """A call of GPU tensors: their devices checked, the results marked, the call observed (the
    call alone timed, on a clocked fetch's thread)."""
    _check_devices(func, args, kwargs, frame)
    out = func(*args, **kwargs) if not clocked else clock.op(func, args, kwargs)
    _mark_results(out, args, kwargs)
    if OBSERVE is not None:
        OBSERVE(func, args, out, frame)
    return out


def _getitem(func: Callable, args: tuple, kwargs: dict, frame: FrameType | None, assigned: bool = False,
             filled: bool = False) -> Any:
    marked = _args_marked(args)  # (an index tuple's ends included)
    call = (lambda: _marked_call(func, args, kwargs or _NO_KWARGS, frame)) if marked else (lambda: func(*args, **kwargs))
    return probes.mask_index_sync(args[1] if len(args) > 1 else None, frame, call, assigned, filled)


def _setitem(func: Callable, args: tuple, kwargs: dict, frame: FrameType | None) -> Any:
    """`t[index] = value`: through a GPU boolean mask, index_put_ turns the mask into indices with a
    nonzero, a sync, unless the value is a host number, which torch fills in place (masked_fill_);
    a tensor bound of a slice is read by the host, as in `t[index]`."""
    value = args[2] if len(args) > 2 else None
    filled = not isinstance(value, torch.Tensor) or (value.numel() == 1 and not getattr(value, CUDA_MARK, False))
    return _getitem(func, args, kwargs, frame, assigned=True, filled=filled)


SPECIAL: dict[Any, Handler] = {
    _T.to: _to,
    _T.cuda: _cuda,
    _T.cpu: _cpu,
    _T.type: _type,
    _T.copy_: _copy_,
    _T.pin_memory: _pin_memory,
    _T.is_pinned: _is_pinned,
    _T.record_stream: _no_op,
    _T.get_device: _get_device,
    _T.device.__get__: _device_get,
    _T.is_cuda.__get__: _is_cuda_get,
    _T.data.__set__: _data_set,
    _T.numpy: _numpy,
    _T.__getitem__: _getitem,  # t[index]: a GPU boolean mask in the index is a sync (probes.mask_index_sync)
    _T.__setitem__: _setitem,  # t[index] = value: so is one assigned through, of a tensor value
    torch._C._nn._parse_to: _parse_to,
}
_resolved: dict[Any, Handler | None] = {}


def _special(func: Callable) -> Handler | None:
    """The handler of `func`, also when it reaches the mode wrapped (torch passes the public
    attribute, e.g. the probes' wrapper of Tensor.to): unwrapped once, then cached."""
    try:
        return _resolved[func]
    except KeyError:
        pass
    except TypeError:  # unhashable
        return None
    f, handler = func, None
    for _ in range(8):
        handler = SPECIAL.get(f)
        if handler is not None or not hasattr(f, "__wrapped__"):
            break
        f = f.__wrapped__
    _resolved[func] = handler
    return handler


# Factories that copy host data to the device when asked for `device="cuda"`.
FROM_HOST_DATA = frozenset({torch.tensor, torch.as_tensor, torch.asarray})


_compiling = torch.compiler.is_compiling
# Called with (func, args, out, frame) after each call of GPU tensors and each factory asked for
# the GPU (rehearsal.ops.observe: matmuls, convolutions, parameter updates, kernel launches), when set
OBSERVE: Callable[[Callable, tuple, Any, FrameType | None], None] | None = None


def _traced(func: Callable, args: tuple, kwargs: dict) -> Any:
    """The mode's work while torch.compile traces the call: the device requests rewritten and the marks passed on,
    nothing else. Dynamo inlines a mode on the stack into the graph it traces; the untraced path (frames, the
    probes' records, device checks) would break the user's graph at every op (a warning about `sys._getframe`
    in the auditor's code, and, with the graph cut into pieces, weights that differ from the CPU run's).
    Setting a mark on a traced tensor is a side effect dynamo replays on the real one, so what the compiled
    code returns carries its marks."""
    name = getattr(func, "__name__", "")
    requested = False
    if kwargs and is_cuda_request(kwargs.get("device")):
        kwargs = {**kwargs, "device": CPU}
        requested = True
    if name in ("to", "cuda") and args and isinstance(args[0], torch.Tensor):
        if name == "cuda":
            func, args, requested = _T.to, (args[0], CPU), True
        elif len(args) > 1 and is_cuda_request(args[1]):
            args, requested = (args[0], CPU, *args[2:]), True
    _mode_traced()
    marked = requested or _args_marked(args) or (bool(kwargs) and _args_marked(tuple(kwargs.values())))
    out = func(*args, **kwargs)
    if marked:
        for t in _tensors(out):
            if not any(t is a for a in args):
                setattr(t, CUDA_MARK, True)
    return out


_MODE_TRACED = [False]  # whether dynamo has traced the mode into a compiled graph (see _mode_traced)


def _mode_traced() -> bool:
    """Run for real as dynamo traces a call to it, in `_traced` (a constant of the compiled code:
    no guard, no side effect replayed): dynamo traces this torch's function modes, and the marks the
    mode sets in a traced call are put on the compiled code's results."""
    _MODE_TRACED[0] = True
    return True


setattr(_mode_traced, torch_private.DYNAMO_CONSTANT, True)  # (torch._dynamo.assume_constant_result's mark)


def _mark_compiled_results(compiled: Any, args: tuple, kwargs: dict, out: Any) -> None:
    """After a call of compiled code (unseen.compiled_call_results), where dynamo has not traced
    the mode into a graph: torch 2.4's dynamo compiles as if no torch-function mode were on the
    stack, and its kernels run outside any torch function, so nothing marked what the compiled code
    made (a compiled model's output then met the GPU labels as a host tensor: a false device mix).
    Its results are marked, as the traced mode marks them, when what it computes from is on the GPU:
    a marked tensor argument, the compiled module's weights, or a tensor or module the compiled
    function reads from its globals or closure. A result that is one of its arguments keeps its own
    device."""
    if _MODE_TRACED[0] or not _compiled_reads_gpu(compiled, args, kwargs):
        return
    for t in _result_tensors(out):
        if not getattr(t, CUDA_MARK, False) and not any(t is a for a in args):
            mark(t)


def _compiled_reads_gpu(compiled: Any, args: tuple, kwargs: dict) -> bool:
    if _args_marked(args) or (bool(kwargs) and _args_marked(tuple(kwargs.values()))):
        return True
    fn = getattr(compiled, "_torchdynamo_orig_callable", compiled)
    owner = getattr(fn, "__self__", None)  # (a compiled module: its bound __call__ or _call_impl)
    if isinstance(owner, torch.nn.Module):
        return _module_on_gpu(owner)
    code, names = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
    if code is None or names is None:
        return False
    read = [names.get(n) for n in code.co_names]
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            read.append(cell.cell_contents)
        except ValueError:  # (an empty cell)
            pass
    return any(is_marked(v) or (isinstance(v, torch.nn.Module) and _module_on_gpu(v)) for v in read)


def _module_on_gpu(module: torch.nn.Module) -> bool:
    """Whether a module's first parameter (or, without parameters, first buffer) is on the GPU."""
    for t in module.parameters():
        return is_marked(t)
    for t in module.buffers():
        return is_marked(t)
    return False


def _result_tensors(out: Any):
    """The tensors of a result: itself, in a tuple or list (two levels, as `_tensors`), or a dict's
    values (a model's output object)."""
    if isinstance(out, dict):
        for v in out.values():
            yield from _tensors(v)
    else:
        yield from _tensors(out)


class RehearsalMode(TorchFunctionMode):
    """Rewrites device requests for CUDA to the CPU and passes GPU marks from inputs to results."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if _compiling():
            return _traced(func, args, kwargs or {})
        # A fetch the rehearsal clocks (CLOCKED_THREAD): the mode's own time is counted apart from
        # the calls' (own_time), for the data-wait probe to take out.
        clocked = clock.CLOCKED_THREAD is not None and threading.get_ident() == clock.CLOCKED_THREAD
        if clocked:
            t0, op0 = time.perf_counter(), clock.OP_S[0]
        try:
            # Every torch call made from Python comes through here (one DataLoader batch of 512 samples
            # is ~1000 calls), so the common case -- no keywords, no CUDA default device -- is kept short.
            try:
                special = _resolved[func]
            except (KeyError, TypeError):
                special = _special(func)
            if special is not None:
                return (special(func, args, kwargs or {}, sys._getframe(1)) if not clocked
                        else clock.op(special, (func, args, kwargs or {}, sys._getframe(1))))
            cur = _device_ctx.CURRENT_DEVICE
            if kwargs or (cur is not None and cur.type == "cuda"):
                return self._with_device(func, args, kwargs or {}, cur is not None and cur.type == "cuda", clocked)
            if _args_marked(args):
                return _marked_call(func, args, _NO_KWARGS, sys._getframe(1), clocked)
            return func(*args) if not clocked else clock.op(func, args)
        finally:
            if clocked:
                own_time.add(time.perf_counter() - t0 - (clock.OP_S[0] - op0) + clock.DISPATCH_S[type(func) is FunctionType])

    def _with_device(self, func: Callable, args: tuple, kwargs: dict, default_cuda: bool, clocked: bool = False) -> Any:
        """Calls with keywords or under a CUDA default device: rewrite `device=` / `pin_memory=`."""
        requested = False
        if kwargs.get("device") is not None:
            if is_cuda_request(kwargs["device"]):
                kwargs = {**kwargs, "device": CPU}
                requested = True
            propagate = False  # an explicit device other than CUDA: the result is not on the GPU
        else:
            if default_cuda and func in _device_ctx._device_constructors():
                kwargs = {**kwargs, "device": CPU}
                requested = True
            propagate = not requested
        on_gpu_inputs = propagate and (_args_marked(args) or _args_marked(tuple(kwargs.values())))
        gen = kwargs.get("generator")
        if gen is not None:
            _check_generator(gen, requested or on_gpu_inputs)
        pinned = bool(kwargs.get("pin_memory"))
        if pinned:
            kwargs = {**kwargs, "pin_memory": False}
        if on_gpu_inputs:
            _check_devices(func, args, kwargs, sys._getframe(2))
        out = func(*args, **kwargs) if not clocked else clock.op(func, args, kwargs)
        if requested:
            _mark_results(out, args, kwargs)
            self._requested(func, out, args, sys._getframe(2))
            if OBSERVE is not None:  # (a factory's fill on the GPU is a kernel launch)
                OBSERVE(func, args, out, sys._getframe(2))
        elif on_gpu_inputs:
            _mark_results(out, args, kwargs)
            if OBSERVE is not None:
                OBSERVE(func, args, out, sys._getframe(2))
        if pinned:
            for t in _tensors(out):
                setattr(t, PINNED_MARK, True)
        return out

    @staticmethod
    def _requested(func: Callable, out: Any, args: tuple, frame: FrameType | None) -> None:
        name = f"torch.{getattr(func, '__name__', 'op')}(device=cuda)"
        rec = probes.REC
        if rec is None or not rec.active:
            return
        if rec.in_data:
            rec.add(m.DATA_DEVICE_OP, name, call_site(frame), 0.0)
        elif func in FROM_HOST_DATA and isinstance(out, torch.Tensor) and caller_is_user(frame):
            src = args[0] if args and isinstance(args[0], torch.Tensor) else out
            rec.add(m.H2D_COPY, name, call_site(frame), 0.0, bytes=_bytes(out), pinned=bool(is_pinned(src)),
                    non_blocking=False, loader=getattr(src, LOADER_MARK, None))


def _check_generator(gen: Any, cuda: bool) -> None:
    """A generator drawing for a tensor of the other device: on a GPU the kernel refuses it (a
    DataLoader shuffling under `set_default_device("cuda")` with a CPU generator, a CUDA generator
    for a host tensor), so the rehearsal refuses it the same way rather than pass what will crash."""
    gen_cuda = bool(getattr(gen, CUDA_MARK, False))
    if isinstance(gen, torch._C.Generator) and gen_cuda != cuda:
        want, found = ("cuda", "cpu") if cuda else ("cpu", "cuda")
        raise RuntimeError(f"Expected a '{want}' device type for generator but found '{found}' "
                           "(CUDA rehearsal: a GPU refuses this call the same way; give it a generator of "
                           f"the tensor's device, torch.Generator(device='{want}'))")


# --- keeping the marks out of pickles ------------------------------------------------------------

# Told of each GPU tensor a pickle takes (serialization.py notes which storages torch.save wrote from the GPU).
ON_GPU_TENSOR_PICKLED: Callable[[torch.Tensor], None] | None = None


def _install_pickle_filter() -> None:
    """`torch.save(model.state_dict())` must write what the CPU run writes: tensors pickle their
    Python attributes, so ours are left out of the state torch collects."""
    import torch._utils as tu

    orig = tu._get_obj_state
    if getattr(orig, "__rehearsal_original__", None) is not None:
        return

    def get_obj_state(obj: Any) -> Any:
        state = orig(obj)
        if CUDA_MARK in getattr(obj, "__dict__", ()) and ON_GPU_TENSOR_PICKLED is not None:
            ON_GPU_TENSOR_PICKLED(obj)
        if isinstance(state, dict) and any(k in state for k in MARKS):
            return {k: v for k, v in state.items() if k not in MARKS}
        if isinstance(state, tuple) and state and isinstance(state[0], dict) and any(k in state[0] for k in MARKS):
            return ({k: v for k, v in state[0].items() if k not in MARKS}, *state[1:])
        return state

    get_obj_state.__rehearsal_original__ = orig  # type: ignore[attr-defined]
    tu._get_obj_state = get_obj_state


def _install_parameter_marks() -> None:
    """`nn.Parameter(t)` makes a new tensor object outside any torch function: it inherits the mark."""
    for cls in (torch.nn.Parameter, getattr(torch.nn, "Buffer", None)):
        if cls is None or "__new__" not in cls.__dict__:
            continue
        orig = cls.__new__

        def new(c: type, data: Any = None, *args: Any, __orig: Callable = orig, **kwargs: Any) -> Any:
            p = __orig(c, data, *args, **kwargs)
            if is_marked(data):
                mark(p)
            return p

        cls.__new__ = staticmethod(new)  # type: ignore[method-assign]


def _install_default_device() -> None:
    """`torch.get_default_device()` answers cuda to the user's code while the default is CUDA;
    torch's own callers get the CPU, where their tensors really are."""
    orig = torch.get_default_device

    def get_default_device() -> torch.device:
        if default_is_cuda():
            return REHEARSED_DEVICE if caller_is_user(sys._getframe(1)) else CPU
        return orig()

    get_default_device.__wrapped__ = orig  # type: ignore[attr-defined]
    torch.get_default_device = get_default_device

    orig_set = torch.set_default_device

    def set_default_device(device: Any) -> None:
        """Recorded (the rules name this line when batches are born on the GPU), then done for real:
        torch's DeviceContext only fills in `device=` arguments, which the mode then rewrites."""
        frame = sys._getframe(1)
        if caller_is_user(frame):
            _record(m.CUDA_STANDIN, "torch.set_default_device", frame,
                    device="cuda" if is_cuda_request(device) else str(device))
        orig_set(device)

    set_default_device.__wrapped__ = orig_set  # type: ignore[attr-defined]
    torch.set_default_device = set_default_device


def _under_rehearsal(fn: Callable) -> Callable:
    """`fn` run with the rehearsal mode on torch's function-mode stack (pushed only when absent)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        mode = _MODE
        if mode is None or any(m is mode for m in torch.overrides._get_current_function_mode_stack()):
            return fn(*args, **kwargs)
        with mode:
            return fn(*args, **kwargs)

    run.__wrapped__ = fn  # type: ignore[attr-defined]
    return run


def _install_checkpoint_recompute() -> None:
    """Activation checkpointing re-runs the user's forward during backward. Backward starts inside a
    torch function (`loss.backward()`, `torch.autograd.grad`), and a mode is off the stack while it
    handles a call, so without this the recompute would run with no rehearsal at all: its results
    unmarked (a GPU layer then "gets a CPU tensor" -- a false device-mix error), `device="cuda"`
    not rewritten, and the reentrant variant's detached inputs unmarked. torch re-enters the
    forward's DeviceContext for the recompute the same way; here the rehearsal mode is re-entered,
    so the recompute is judged exactly as its forward was (real mixes in the block still fail).
    Both variants keep their inputs as saved tensors. Under saved-tensor hooks (an enclosing
    checkpoint, `save_on_cpu`, the program's own pack/unpack) they come back as new tensor objects,
    without the mark (autograd wraps what the unpack hook returns in a new tensor even when the
    hook returns a marked one), so the marks they had when saved are put back before the recompute
    sees them: the non-reentrant variant where torch reads its inputs back (torch_private), the
    reentrant one by the `run_function` its backward calls with the detached inputs."""

    frame_cls = torch_private.checkpoint_frame()  # use_reentrant=False
    if frame_cls is not None and not hasattr(frame_cls.__init__, "__wrapped__"):
        orig_init = frame_cls.__init__

        def __init__(self: Any, recompute_fn: Callable, *args: Any, **kwargs: Any) -> None:
            orig_init(self, _under_rehearsal(recompute_fn), *args, **kwargs)

        __init__.__wrapped__ = orig_init  # type: ignore[attr-defined]
        frame_cls.__init__ = __init__
    torch_private.keep_checkpoint_input_marks(is_marked, mark)
    fn_cls = torch_private.lookup("torch.utils.checkpoint:CheckpointFunction")  # use_reentrant=True: its backward recomputes
    if fn_cls is not None and not hasattr(fn_cls.backward, "__wrapped__"):
        orig_forward = fn_cls.forward

        def forward(ctx: Any, run_function: Callable, preserve_rng_state: bool, *args: Any) -> Any:
            """The forward as torch's; then the recompute's `run_function` marks its inputs again
            (the forward itself ran the user's function unwrapped, on the marked originals)."""
            out = orig_forward(ctx, run_function, preserve_rng_state, *args)
            marked = [is_marked(a) for a in args]
            if any(marked):
                ctx.run_function = _remarking(ctx.run_function, marked)
            return out

        forward.__wrapped__ = orig_forward  # type: ignore[attr-defined]
        fn_cls.forward = staticmethod(forward)
        fn_cls.backward = staticmethod(_under_rehearsal(fn_cls.backward))


def _remarking(fn: Callable, marked: list[bool]) -> Callable:
    """`fn` called with the marks put back on its tensor arguments, by position: the reentrant
    checkpoint's backward passes the saved inputs (detached) in the order the forward got them."""
    def rerun(*args: Any, **kwargs: Any) -> Any:
        for a, was_marked in zip(args, marked):
            if was_marked and isinstance(a, torch.Tensor):
                mark(a)
        return fn(*args, **kwargs)

    rerun.__wrapped__ = fn  # type: ignore[attr-defined]
    return rerun


_MODE: RehearsalMode | None = None


def install() -> RehearsalMode:
    """Push the mode for the rest of the process (it is never popped) and the helpers around it."""
    global _MODE
    if _MODE is None:
        _install_pickle_filter()
        _install_parameter_marks()
        _install_default_device()
        _install_checkpoint_recompute()
        from auditor.capture.rehearsal.functorch_marks import install_functorch_marks

        install_functorch_marks(CUDA_MARK)
        unseen.compiled_call_results(_mark_compiled_results)
        _MODE = RehearsalMode()
        _MODE.__enter__()
        torch.nn.modules.module.register_module_forward_pre_hook(_leaf_inputs_on_host)
    return _MODE
