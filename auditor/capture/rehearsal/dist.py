"""CUDA rehearsal, the torch.distributed side: a job written for GPUs runs its ranks on gloo.

A GPU job asks for NCCL (`init_process_group("nccl")`, `"cpu:gloo,cuda:nccl"`, a CUDA
`device_id=`) and places DDP on its device (`DDP(model, device_ids=[local_rank],
output_device=local_rank)`). A CPU build of torch has no NCCL, and DDP refuses device ids for a
module whose parameters are on the CPU, so without this the job ends at its first line of setup
("Distributed package doesn't have NCCL built in"). Here NCCL becomes gloo, which runs the same
collectives on the CPU tensors the rehearsal computes with, and DDP's device arguments are left
out; each is recorded at the user's line (`cuda-standin`). The probes wrap these functions in turn,
so they still see the arguments as the user wrote them.
"""
from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Callable

import torch

from auditor.capture.rehearsal.cuda import _record
from auditor.capture.rehearsal.device import caller_is_user, is_cuda_request, is_marked


def cpu_backend(backend: Any) -> Any:
    """The backend gloo gives for `backend`: "nccl" -> "gloo"; "cpu:gloo,cuda:nccl" -> "cpu:gloo,cuda:gloo"."""
    if not isinstance(backend, str) or "nccl" not in backend.lower():
        return backend
    if ":" not in backend:
        return "gloo"
    pairs = [p.split(":", 1) for p in backend.split(",")]
    return ",".join(f"{dev}:{'gloo' if name.strip().lower() == 'nccl' else name}" for dev, name in pairs)


def _wrap(owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    orig = getattr(owner, name, None)
    if orig is None or getattr(orig, "__rehearsal_original__", None) is not None:
        return
    new = make(orig)
    functools.update_wrapper(new, orig)
    new.__rehearsal_original__ = orig  # (not the probes' mark: they must still wrap it)
    setattr(owner, name, new)


def _on_gloo(what: str) -> Callable[[Callable], Callable]:
    """init_process_group / new_group: NCCL asked for runs on gloo, a CUDA device_id is dropped."""
    def make(orig: Callable) -> Callable:
        sig = inspect.signature(orig)

        def rehearsal_group(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError:
                return orig(*args, **kwargs)  # torch's own error for the user's call
            given = bound.arguments
            changed = []
            if "backend" in given and cpu_backend(given["backend"]) != given["backend"]:
                changed.append(f"backend={given['backend']!r}")
                given["backend"] = cpu_backend(given["backend"])
            if is_cuda_request(given.get("device_id")):
                changed.append("device_id")
                del given["device_id"]
            frame = sys._getframe(1)
            if changed and caller_is_user(frame):
                _record(f"{what}({', '.join(changed)}) on gloo", frame)
            return orig(*bound.args, **bound.kwargs)
        return rehearsal_group
    return make


def _ddp_on_cpu(orig: Callable) -> Callable:
    """DistributedDataParallel(module, device_ids, output_device): without the device arguments
    when the module is on the rehearsed GPU (on the CPU for real, where DDP refuses them)."""
    sig = inspect.signature(orig)

    def rehearsal_ddp_init(ddp: Any, *args: Any, **kwargs: Any) -> None:
        try:
            bound = sig.bind(ddp, *args, **kwargs)
        except TypeError:
            return orig(ddp, *args, **kwargs)
        given = bound.arguments
        module = given.get("module")
        asked = [k for k in ("device_ids", "output_device") if given.get(k) is not None]
        if asked and isinstance(module, torch.nn.Module) and any(is_marked(p) for p in module.parameters()):
            for k in asked:
                del given[k]
            frame = sys._getframe(1)
            if caller_is_user(frame):
                _record(f"DistributedDataParallel({', '.join(asked)}) on the CPU", frame)
        return orig(*bound.args, **bound.kwargs)
    return rehearsal_ddp_init


def install() -> None:
    """Wrap torch.distributed's group creation and DDP's constructor (when distributed is built)."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    import torch.distributed.distributed_c10d as c10d
    from torch.nn.parallel import DistributedDataParallel

    for name in ("init_process_group", "new_group"):
        for owner in (c10d, dist):
            _wrap(owner, name, _on_gloo(f"torch.distributed.{name}"))
    _wrap(DistributedDataParallel, "__init__", _ddp_on_cpu)
