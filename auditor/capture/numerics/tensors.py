"""Which tensors the checks measure, and how they are read from a call's arguments and result."""
from __future__ import annotations

from typing import Any

import torch

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided
_HALF = torch.float16


# floating dtypes torch has no reductions for (aminmax, isfinite): a float8 tensor is a cast of a
# wider one, which is checked
_UNMEASURED = frozenset(d for d in (getattr(torch, n, None) for n in (
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2"))
    if d is not None)
_MKLDNN = torch._mkldnn


def _checkable(t: Any) -> bool:
    """A plain (or Parameter) floating or complex tensor with data (a complex one is measured
    through its real and imaginary parts, see `_real`; a sparse one through its stored values, see
    `_stored`): subclasses (DTensor, fake/functorch tensors) are left alone, since reducing them
    could run collectives or escape a transform, and so are what torch cannot reduce (float8,
    nested and MKL-DNN tensors): the checks must never raise into the program."""
    return (type(t) in _PLAIN_TYPES and (t.dtype.is_floating_point or t.dtype.is_complex) and not t.is_meta
            and t.numel() > 0 and not _is_wrapped(t) and t.dtype not in _UNMEASURED and t.layout is not _MKLDNN
            and not t.is_nested)


try:
    _is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
except AttributeError:  # pragma: no cover - a torch without it
    def _is_wrapped(t: Any) -> bool:
        return False


def _real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as the floats it holds (real and imaginary parts): its range, and whether
    all are finite; a real tensor as it is."""
    return torch.view_as_real(t) if t.dtype.is_complex else t


def _stored(t: torch.Tensor) -> torch.Tensor:
    """A strided tensor whose range, and whether all of it is finite, are `t`'s: `t` itself, or a
    sparse tensor's stored values (COO, CSR and the like: torch's reductions run on the strided
    layout only), with a zero beside them where not every element is stored (the implicit
    zeros are in its range)."""
    if t.layout is _STRIDED:
        return t
    values = (t._values() if t.is_sparse else t.values()).reshape(-1)
    return values if values.numel() == t.numel() else torch.cat([values, values.new_zeros(1)])


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


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    """Floating tensors in a call's result or arguments (one level of tuples/lists)."""
    if isinstance(obj, torch.Tensor):
        return [obj] if _checkable(obj) else []
    if isinstance(obj, (tuple, list)):
        return [t for t in obj if isinstance(t, torch.Tensor) and _checkable(t)]
    return []
