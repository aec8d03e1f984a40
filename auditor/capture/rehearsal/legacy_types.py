"""CUDA rehearsal, the legacy tensor types: `torch.cuda.FloatTensor` and its kin as GPU tensors.

Older programs spell the device with a tensor type: `Tensor = torch.cuda.FloatTensor if cuda else
torch.FloatTensor`, then `Tensor(n, 1).fill_(1.0)`, `Tensor(np.random.normal(...))`,
`imgs.type(Tensor)`, `isinstance(t, torch.cuda.FloatTensor)`, `set_default_tensor_type(...)`.
A CPU-only torch refuses every one ("type torch.cuda.FloatTensor not available"), and the
rehearsal tells the program it has a GPU, so each type is a stand-in here:

* calling it makes what the CPU type makes (`torch.FloatTensor(...)`: the same values), marked as
  the GPU's; built from host data (a list, an array, a host tensor) it is a host->device copy
  (`h2d-copy`, at the user's line), from sizes alone a device allocation; inside DataLoader
  iteration either is device work there (`data-device-op`);
* `t.type(torch.cuda.FloatTensor)` is a move to the device (auditor.capture.rehearsal.device
  reads the type's name); `isinstance(t, torch.cuda.FloatTensor)` is true of a GPU tensor of that
  dtype;
* `torch.set_default_tensor_type(torch.cuda.FloatTensor)` (or its name) sets the dtype and makes
  CUDA the default device, as it does on a GPU;
* `Variable(t)`, which wraps them in that code, keeps t's marks (torch makes a new tensor object).
"""
from __future__ import annotations

import sys
from typing import Any

import torch

from auditor.capture import probes
from auditor.capture.rehearsal import device
from auditor.evidence import model as m

NAMES = ("FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "LongTensor", "IntTensor",
         "ShortTensor", "CharTensor", "ByteTensor", "BoolTensor")


class _LegacyType(type):
    """The class of the stand-ins: `isinstance(t, torch.cuda.FloatTensor)` holds for a GPU tensor
    of the type's dtype (a CPU-only torch answers False for every tensor)."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor) and device.is_marked(obj) and obj.dtype == cls.dtype

    def __repr__(cls) -> str:
        return f"<class 'torch.cuda.{cls.__name__}'>"


def _sizes_only(args: tuple, kwargs: dict) -> bool:
    """Whether a legacy constructor's arguments are sizes (an allocation), not data to copy."""
    if "size" in kwargs or not args:
        return True
    if len(args) == 1 and isinstance(args[0], torch.Size):
        return True
    return all(isinstance(a, int) and not isinstance(a, bool) for a in args)


def _record(out: torch.Tensor, src: Any, sizes: bool, what: str, frame: Any) -> None:
    rec = probes.REC
    if rec is None or not rec.active:
        return
    if rec.in_data:
        rec.add(m.DATA_DEVICE_OP, what, device.call_site(frame), 0.0)
    elif not sizes:  # host data (or a host tensor) copied onto the device
        pinned = isinstance(src, torch.Tensor) and device.is_pinned(src)
        rec.add(m.H2D_COPY, what, device.call_site(frame), 0.0, bytes=out.numel() * out.element_size(),
                pinned=bool(pinned), non_blocking=False, loader=getattr(src, device.LOADER_MARK, None))


def _stand_in(name: str, host: Any) -> type:
    what = f"torch.cuda.{name}"

    def __new__(cls: type, *args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs.pop("device", None)  # (`device="cuda"` is the type's own device)
        sizes = _sizes_only(args, kwargs)
        src = args[0] if len(args) == 1 else None
        if isinstance(src, torch.Tensor) and device.is_marked(src) and src.dtype == host.dtype:
            return src  # already a GPU tensor of this type: the constructor hands it back
        out = host(*args, **kwargs)
        if isinstance(src, torch.Tensor) and out.data_ptr() == src.data_ptr():
            out = out.detach()  # (the CPU type aliases a host tensor of its dtype: mark the alias only)
        device.mark(out)
        _record(out, src, sizes, f"{what}(" + ("sizes)" if sizes else "host data)"), sys._getframe(1))
        return out

    return _LegacyType(name, (), {"__new__": __new__, "__module__": "torch.cuda", "__qualname__": name,
                                  "dtype": host.dtype, "is_cuda": True, "is_sparse": False,
                                  "__doc__": f"Rehearsal stand-in for {what} (a {host.__name__} marked as the GPU's)."})


def _install_default_tensor_type() -> None:
    orig = torch.set_default_tensor_type

    def set_default_tensor_type(t: Any) -> None:
        name = t if isinstance(t, str) else f"{getattr(t, '__module__', '')}.{getattr(t, '__name__', '')}"
        if not name.startswith("torch.cuda."):
            return orig(t)
        host = getattr(torch, name[len("torch.cuda."):])
        orig(host)  # the dtype, as a GPU run sets it (and its deprecation warning, as torch gives it)
        torch.set_default_device("cuda")  # (the rehearsal's own, which records the user's line)

    set_default_tensor_type.__wrapped__ = orig  # type: ignore[attr-defined]
    torch.set_default_tensor_type = set_default_tensor_type


def _install_variable_marks() -> None:
    """`Variable(t)` makes a new tensor object sharing t's data (torch's C constructor): it keeps
    t's marks (a GPU tensor stays one, a batch stays its DataLoader's)."""
    from torch.autograd.variable import Variable

    if "__new__" in Variable.__dict__:
        return
    base = torch._C._LegacyVariableBase

    def __new__(cls: type, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = base.__new__(cls, *args, **kwargs)
        src = args[0] if args else kwargs.get("data")
        if isinstance(src, torch.Tensor) and src is not out:
            for mark in device.MARKS:
                if mark in src.__dict__:
                    setattr(out, mark, src.__dict__[mark])
        return out

    Variable.__new__ = staticmethod(__new__)  # type: ignore[method-assign]


def install() -> list[str]:
    """Put the stand-ins on torch.cuda (see module doc); returns the names replaced."""
    _install_variable_marks()
    replaced = []
    for name in NAMES:
        host = getattr(torch, name, None)
        if host is not None and hasattr(torch.cuda, name):
            setattr(torch.cuda, name, _stand_in(name, host))
            replaced.append(name)
    _install_default_tensor_type()
    return replaced + ["set_default_tensor_type"]
