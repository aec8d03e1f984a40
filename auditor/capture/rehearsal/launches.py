"""CUDA rehearsal, the launch side: how many kernels the program's GPU calls would launch a step.

`rehearsal.ops.observe` passes on each call of GPU tensors that launches a kernel (its name from
`launch_name`); `count` adds it to the step's `device-launch` tally at the user's line
(evidence.model.DEVICE_LAUNCH), with the bytes it moves, its FLOPs where known, in size classes the
rules price on any device row, and whether autograd recorded it (`grad`).
One call counts as one launch: a lower bound (composite ops launch several; the C++ backward is not
seen). Not counted: views and metadata, host reads (their own rules count them), and torch.optim's
own code, which a rehearsal runs per parameter on the CPU where a GPU run takes the foreach path.
An optimizer or update loop written in the user's code is counted as it runs.
Nothing here changes a call's arguments or results.
"""
from __future__ import annotations

import os
from types import FrameType
from typing import Any, Callable

import torch

from auditor.capture import probes
from auditor.capture.frames import on_forget
from auditor.capture.rehearsal.call_sites import call_site_and_caller
from auditor.evidence import model as m

_Tensor = torch.Tensor

# Functions (by name) whose call on a GPU launches no kernel: views and metadata, host reads,
# factories that only allocate, and calls that are not one kernel (backward).
NO_LAUNCH = frozenset((
    "view", "view_as", "reshape", "reshape_as", "size", "stride", "dim", "ndimension", "numel", "nelement",
    "element_size", "storage_offset", "is_contiguous", "is_floating_point", "is_complex", "is_signed",
    "detach", "detach_", "t", "t_", "transpose", "transpose_", "permute", "expand", "expand_as", "as_strided",
    "unsqueeze", "unsqueeze_", "squeeze", "squeeze_", "flatten", "unflatten", "narrow", "select", "split",
    "split_with_sizes", "chunk", "unbind", "tensor_split", "hsplit", "vsplit", "dsplit", "movedim", "moveaxis",
    "swapaxes", "swapdims", "diagonal", "real", "imag", "view_as_real", "view_as_complex", "unfold",
    "requires_grad_", "retain_grad", "register_hook", "data_ptr", "untyped_storage", "storage", "__len__",
    "__iter__", "__hash__", "__get__", "__set__", "__reduce_ex__", "__setstate__", "__getstate__", "__format__",
    "__repr__", "__str__", "__array__", "__dlpack__", "item", "tolist", "__bool__", "__int__", "__float__",
    "__index__", "__complex__", "numpy", "backward", "has_names", "rename", "refine_names", "is_set_to",
    "new_empty", "new_empty_strided", "empty_like", "empty", "empty_strided", "tensor", "as_tensor", "asarray",
    "from_numpy", "get_device", "type", "is_pinned", "pin_memory", "record_stream", "resize_", "resize_as_",
    "set_", "is_inference", "dim_order", "align_as", "align_to",
))

# Ops that take their tensor inputs' shape only (and fills, which write without reading): their
# bytes moved are their outputs'.
SHAPE_ONLY = frozenset((
    "Tensor.new_zeros", "Tensor.new_ones", "Tensor.new_full", "torch.zeros_like", "torch.ones_like",
    "torch.full_like", "torch.rand_like", "torch.randn_like", "torch.randint_like", "Tensor.zero_", "Tensor.fill_",
    "Tensor.normal_", "Tensor.uniform_", "Tensor.bernoulli_", "Tensor.random_", "Tensor.exponential_",
))

# by whether autograd recorded the call, then bytes class
_NO_FLOPS = [[(("bytes_class", b), ("flops_class", 0), ("dtype", ""), ("grad", g)) for b in range(80)] for g in (0, 1)]

_OPTIM_DIR = os.path.normcase(os.path.realpath(os.path.dirname(torch.optim.__file__))) + os.sep
_optim_code: dict[int, bool] = {}  # id(code) -> whether it is torch.optim's (the code kept in _KEPT)
_KEPT: list = []
on_forget(lambda: (_optim_code.clear(), _KEPT.clear()))  # (at the program's end: frames.forget_codes)


def op_name(func: Callable) -> str:
    """How a finding names the op: "Tensor.mul_", "torch.tanh", "F.linear"."""
    name = getattr(func, "__name__", "op")
    qual = getattr(func, "__qualname__", name) or name
    module = getattr(func, "__module__", "") or ""
    if qual.split(".")[0] in ("TensorBase", "Tensor", "_TensorBase"):
        return f"Tensor.{name}"
    if module.startswith("torch.nn.functional") or module == "torch._C._nn":
        return f"F.{name}"
    return f"torch.{name}"


def launch_name(func: Callable) -> str | None:
    """The op's name when its call on GPU tensors launches a kernel on a GPU; None when it does not."""
    name = getattr(func, "__name__", None)
    if not isinstance(name, str) or name in NO_LAUNCH:
        return None
    return op_name(func)


def _indexing_launches(args: tuple) -> bool:
    """`t[index]`: a gather kernel for a tensor or list index; a view for ints, slices, None and ..."""
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, (_Tensor, list)) for p in parts)


def _bytes(t: Any) -> int:
    """What a tensor holds in memory: a strided one its elements, a sparse one its stored values
    and their indices (a COO's `nbytes` raises; a dense count would be the size it is not)."""
    if t.layout is torch.strided:
        return t.nbytes
    if t.is_sparse:
        return t._values().nbytes + t._indices().nbytes
    try:  # CSR, CSC, BSR, BSC: values and their compressed and plain indices
        compressed, plain = ((t.crow_indices(), t.col_indices()) if t.layout in (torch.sparse_csr, torch.sparse_bsr)
                             else (t.ccol_indices(), t.row_indices()))
        return t.values().nbytes + compressed.nbytes + plain.nbytes
    except (RuntimeError, AttributeError):  # (another layout: its size not known)
        return 0


def _nbytes(x: Any) -> int:
    if isinstance(x, _Tensor):
        return _bytes(x)
    if isinstance(x, (tuple, list)):
        return sum(_bytes(t) for t in x if isinstance(t, _Tensor))
    return 0


def recorded_for_backward(out: Any) -> int:
    """1 when autograd recorded the call that returned `out` (an output has a grad_fn): the backward
    pass runs its derivative's kernels; 0 for a call under no_grad or on tensors that need no
    gradient (an evaluation's forward, an update loop), which launches its own kernels alone."""
    if type(out) is _Tensor or isinstance(out, _Tensor):
        return int(out.grad_fn is not None)
    if isinstance(out, (tuple, list)):
        return int(any(isinstance(t, _Tensor) and t.grad_fn is not None for t in out))
    return 0


def _in_optim(frame: FrameType) -> bool:
    code = frame.f_code
    v = _optim_code.get(id(code))
    if v is None:
        v = _optim_code[id(code)] = os.path.normcase(os.path.realpath(code.co_filename)).startswith(_OPTIM_DIR)
        _KEPT.append(code)
    return v


def count(what: str, args: tuple, out: Any, frame: FrameType | None, flops: int = 0) -> None:
    """One launch of `what` (a GPU call that ran with `args` and returned `out`) at the user's line."""
    rec = probes.REC
    if rec is None or not rec.active or rec.in_data or frame is None or _in_optim(frame):
        return
    if what == "Tensor.__getitem__" and not _indexing_launches(args):
        return
    if what == "Tensor.contiguous" and args and out is args[0]:
        return  # already contiguous: no copy
    try:
        nbytes = _bytes(out) if type(out) is _Tensor else _nbytes(out)  # (a tensor, most calls: one call)
        if what not in SHAPE_ONLY:
            for a in args:
                if isinstance(a, _Tensor):
                    nbytes += _bytes(a)
    except RuntimeError:  # (a tensor whose size cannot be read: the launch is counted, its size not known)
        nbytes = 0
    grad = recorded_for_backward(out)
    if flops:
        dtype = str(out.dtype).replace("torch.", "") if isinstance(out, _Tensor) else ""
        fixed = (("bytes_class", nbytes.bit_length()), ("flops_class", int(flops).bit_length()), ("dtype", dtype),
                 ("grad", grad))
    else:
        fixed = _NO_FLOPS[grad][nbytes.bit_length()]
    # (with the line that called the user's function: a loop there runs the function's launches per element)
    site, caller = call_site_and_caller(frame)
    rec.add_sums(m.DEVICE_LAUNCH, what, site, fixed + (("caller", caller),), bytes=nbytes, flops=flops)
