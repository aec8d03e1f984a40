"""What kind of call a torch function is, and its readable name.

The mode decides each call by one dict lookup in `_kinds` (filled by `_classify` on first sight):
metadata and view calls are passed straight through (SKIP), hazard kinds (log, div, exp, sqrt,
pow, norm) get one extra statistic per call (see Numerics._hazard_stat), everything else is PLAIN.
Elementwise monotone calls of one tensor (relu, sigmoid, tanh) have their output's range derived
from their input's on the host (`_monotone`), without a reduction of their own.
"""
from __future__ import annotations

import functools
import math
import sys
from typing import Any, Callable

import torch

from auditor.capture.frames import is_library

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


@functools.lru_cache(maxsize=1024)
def _module_op_name(cls: type) -> str:
    """A leaf module's op name: torch.nn.Linear, timm.layers.mlp.Mlp."""
    module = cls.__module__
    if module.startswith("torch.nn.modules."):
        module = "torch.nn"
    return f"{module}.{cls.__qualname__}"


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
_LEAF_MONOTONE = {torch.nn.ReLU: _relu, torch.nn.Sigmoid: _sigmoid, torch.nn.Tanh: _tanh}


def _monotone(func: Callable, kind: int, ins: list[torch.Tensor]) -> Callable[[float], float] | None:
    """The scalar function a one-input monotone call (relu, exp, ...) applies, else None: its
    output range is then derived from its input's, without a reduction."""
    return _MONOTONE.get(getattr(func, "__name__", "")) if kind == PLAIN and len(ins) == 1 else None

