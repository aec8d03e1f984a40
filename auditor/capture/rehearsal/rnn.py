"""nn.LSTM under the rehearsal's autocast.

A rehearsal's `autocast("cuda")` is CPU autocast (rehearsal.cuda), and CPU autocast runs `torch.lstm`
in oneDNN's lower-precision LSTM, which oneDNN cannot build on a CPU without AVX-512 ("could not
create a primitive descriptor for the LSTM forward propagation primitive": torch 2.13 on an AVX2
AMD EPYC, in float16 and bfloat16 alike). A program that trains on its GPU would stop in its
rehearsal there. Such a call runs again with oneDNN off, in torch's own LSTM kernels, and so does
every later LSTM call under autocast in the process: the call had failed before computing anything.
"""
from __future__ import annotations

from types import FrameType
from typing import Any, Callable

import torch

from auditor.capture.rehearsal import device

# set once oneDNN has refused an LSTM under autocast in this process
_NATIVE = [False]


def _call(func: Callable, args: tuple, kwargs: dict, frame: FrameType | None) -> Any:
    """The call as the mode makes one it has no handler for: of GPU tensors (positional or
    keyword), checked, marked and observed."""
    if device._args_marked(args) or (kwargs and device._args_marked(tuple(kwargs.values()))):
        return device._marked_call(func, args, kwargs, frame)
    return func(*args, **kwargs)


def _without_onednn(func: Callable, args: tuple, kwargs: dict, frame: FrameType | None) -> Any:
    # (torch._C's switch, not torch.backends.mkldnn.flags: that one warns about TF32 on the
    # program's stderr)
    was = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        return _call(func, args, kwargs, frame)
    finally:
        torch._C._set_mkldnn_enabled(was)


def _lstm(func: Callable, args: tuple, kwargs: dict, frame: FrameType | None) -> Any:
    if not torch.is_autocast_enabled("cpu"):
        return _call(func, args, kwargs, frame)
    if _NATIVE[0]:
        return _without_onednn(func, args, kwargs, frame)
    try:
        return _call(func, args, kwargs, frame)
    except RuntimeError as e:
        if "primitive descriptor" not in str(e) or not torch._C._get_mkldnn_enabled():
            raise
    _NATIVE[0] = True
    return _without_onednn(func, args, kwargs, frame)


def install() -> None:
    device.SPECIAL[torch.lstm] = _lstm
