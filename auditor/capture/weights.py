"""The `weights` collector: a digest of the trained state at the end of the audited steps.

`audit run --verify` compares it between the audited run and a re-run with fixes.patch applied:
equal digests mean the patched program computed the same weights. Installed only when asked
(`--digest`): hashing every parameter costs a device-to-host copy of the whole model.

The trained state is every torch.optim.Optimizer alive at the end: each one's parameters, in its
param_groups' order, and its per-parameter state (exp_avg, step, momentum buffers), keys sorted.
Each tensor contributes its dtype, shape and raw bytes. The optimizers' own digests are sorted
before they are joined, so the order the garbage collector lists them in does not matter.
"""
from __future__ import annotations

import gc
import hashlib
from typing import Any


def _tensor_bytes(t: Any) -> bytes:
    import torch

    t = t.detach()
    if t.is_sparse or getattr(t, "is_nested", False):
        t = t.to_dense()
    t = t.to("cpu").contiguous().reshape(-1)
    if t.numel() == 0:
        return b""
    return t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else t.to(torch.uint8).numpy().tobytes()


def _feed(h: Any, value: Any, counts: dict[str, int]) -> None:
    import torch

    if isinstance(value, torch.Tensor):
        data = _tensor_bytes(value)
        h.update(f"{value.dtype}{tuple(value.shape)}".encode())
        h.update(data)
        counts["tensors"] += 1
        counts["bytes"] += len(data)
    else:
        h.update(repr(value).encode())


def optimizer_digest(opt: Any, counts: dict[str, int]) -> str:
    """sha256 of one optimizer's parameters and per-parameter state, in its param_groups' order."""
    h = hashlib.sha256()
    for group in opt.param_groups:
        for p in group["params"]:
            _feed(h, p, counts)
            state = opt.state.get(p, {})
            for key in sorted(state, key=str):
                h.update(str(key).encode())
                _feed(h, state[key], counts)
    return h.hexdigest()


def live_optimizers() -> list[Any]:
    """Every torch.optim.Optimizer the garbage collector knows."""
    import torch

    # (type(), not isinstance: isinstance reads `__class__`, which some of torch's deprecated
    # objects turn into a warning the user would see)
    return [o for o in gc.get_objects() if issubclass(type(o), torch.optim.Optimizer)]


def weights_digest(opts: list[Any]) -> dict[str, Any] | None:
    """{"sha256", "optimizers", "tensors", "bytes"} of `opts` (None when there is none: nothing
    was trained through torch.optim)."""
    import torch

    if not opts:
        return None
    counts = {"tensors": 0, "bytes": 0}
    with torch.no_grad():
        digests = sorted(optimizer_digest(o, counts) for o in opts)
    return {"sha256": hashlib.sha256("".join(digests).encode()).hexdigest(), "optimizers": len(opts), **counts}


class Weights:
    """The collector (auditor.capture.collectors): the digest at the end of the run, of the
    optimizers alive then and those found at the end of a step. A whole program's optimizers are
    gone by its end (its `__main__` is freed once it has run): they are looked for at the end of
    each step until some are found, and held until the digest is taken."""

    name = "weights"

    def __init__(self) -> None:
        self.held: list[Any] = []

    def install(self) -> None:
        pass

    def step_begin(self, index: int) -> None:
        pass

    def step_end(self, index: int) -> None:
        if not self.held:
            self.held = live_optimizers()
        return None

    def finish(self) -> dict[str, Any] | None:
        try:
            alive = live_optimizers()
            return weights_digest(self.held + [o for o in alive if not any(o is h for h in self.held)])
        except Exception as e:  # (a tensor that cannot be read back: no digest, and why)
            return {"sha256": "", "optimizers": 0, "tensors": 0, "bytes": 0, "error": f"{type(e).__name__}: {e}"}
