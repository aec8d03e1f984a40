"""Syncs an indexing makes, handed over by the torch-function modes that see each `t[index]` (the
CUDA rehearsal's): Tensor.__getitem__ is never wrapped on the class, since a Python `__getitem__`
on torch.Tensor makes every tensor a sequence to CPython (its sq_item slot), and `torch.tensor([t])`
of a 0-d tensor then raises "len() of a 0-d tensor" where plain torch builds it. On a GPU the
profiled window's trace shows these syncs."""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from auditor.capture.frames import is_torch_internal, user_frame
from auditor.capture.unseen import no_torch_function
from auditor.evidence import model as m


def _bool_mask(index: Any) -> torch.Tensor | None:
    """The boolean mask in an index (`t[mask]`, `t[:, mask]`, `t[mask, 0]`): what it selects has as
    many rows as the mask has True values, a count the host must read (a nonzero) to size it."""
    for i in (index if type(index) is tuple else (index,)):
        if isinstance(i, torch.Tensor) and i.dtype == torch.bool and i.dim() > 0:
            return i
    return None


def _slice_bound(index: Any) -> torch.Tensor | None:
    """A tensor bound of a slice in an index (`data[i:i + T]` with `i` a tensor): the host reads
    its value (`__index__`, an `item`) to know where the slice starts or ends."""
    for i in (index if type(index) is tuple else (index,)):
        if type(i) is slice:
            for bound in (i.start, i.stop, i.step):
                if isinstance(bound, torch.Tensor):
                    return bound
    return None


def index_sync(rec: Any, device_of: Callable[[Any], str], cuda_only: bool, dispatchers: frozenset[str],
               index: Any, frame: Any, call: Callable[[], Any], assigned: bool = False, filled: bool = False) -> Any:
    """`call()`, the indexing `t[index]` made at `frame`, recorded on the probes' recorder `rec` as
    a sync when the index holds a boolean mask of the device (`logits[mask]`), or a slice with a
    bound of the device (`data[i:i + T]` for `i` in a GPU tensor: one read a slice). An assignment
    through a mask (`t[mask] = values`: assigned) syncs as its selection does, as index_put_ turns
    the mask into indices; of a host number (filled) torch fills the mask in place and reads
    nothing back. `device_of`, `cuda_only` and `dispatchers` are the probes' (probes.DEVICE_OF,
    JUDGE_AS_CUDA, _DISPATCHERS)."""
    if (rec is None or not rec.active or rec.in_data or frame is None
            or not isinstance(index, (torch.Tensor, tuple, slice))):
        return call()
    code = frame.f_code
    if code.co_name in dispatchers or is_torch_internal(code.co_filename):
        return call()
    with no_torch_function():  # (the auditor's reads: the user's modes see the call only)
        what = "Tensor[bool mask] = tensor" if assigned else "Tensor[bool mask]"
        read = None if filled else _bool_mask(index)
        if read is None:
            what, read = "Tensor[tensor:slice]", _slice_bound(index)
        dev = device_of(read) if read is not None else None
    if dev is None or (cuda_only and dev != "cuda"):
        return call()
    t0 = time.perf_counter()
    try:
        return call()
    finally:
        rec.add(m.SYNC, what, user_frame(frame), (time.perf_counter() - t0) * 1e3, device=dev)
