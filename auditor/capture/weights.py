"""The `weights` collector: a digest of the trained state at the end of the audited steps.

`audit run --verify` compares it between the audited run and a re-run with fixes.patch applied:
equal digests mean the patched program computed the same weights. Installed only when asked
(`--digest`): hashing every parameter costs a device-to-host copy of the whole model.

The trained state is every torch.optim.Optimizer alive at the end: each one's parameters, in its
param_groups' order, and its per-parameter state (exp_avg, step, momentum buffers), keys sorted.
A program that updates its weights without torch.optim (`p.data.add_(p.grad, alpha=-lr)`: the
steps the step finder marks by weight updates) has none: its trained state is then every root
module alive (an nn.Module no other live module holds) with a parameter that takes a gradient,
each one's parameters in `named_parameters()` order. Each tensor contributes its dtype, shape and
raw bytes. The optimizers' (or the modules') own digests are sorted before they are joined, so the
order the garbage collector lists them in does not matter.
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


def module_digest(module: Any, counts: dict[str, int]) -> str:
    """sha256 of one module's parameters, in `named_parameters()` order, names included."""
    h = hashlib.sha256()
    for name, p in module.named_parameters():
        h.update(name.encode())
        _feed(h, p, counts)
    return h.hexdigest()


def _is_optimizer(o: Any) -> bool:
    import torch

    return issubclass(type(o), torch.optim.Optimizer)


def live_trained() -> list[Any]:
    """Every torch.optim.Optimizer the garbage collector knows; where there is none, every root
    module with a parameter that takes a gradient (the weights a hand-written update trains)."""
    import torch

    objects = gc.get_objects()
    # (type(), not isinstance: isinstance reads `__class__`, which some of torch's deprecated
    # objects turn into a warning the user would see)
    opts = [o for o in objects if _is_optimizer(o)]
    if opts:
        return opts
    modules = [o for o in objects if issubclass(type(o), torch.nn.Module)]
    held = {id(c) for mod in modules for c in mod.children()}
    return [mod for mod in modules if id(mod) not in held and any(p.requires_grad for p in mod.parameters())]


def weights_digest(opts: list[Any]) -> dict[str, Any] | None:
    """{"sha256", "optimizers", "modules", "tensors", "bytes"} of `opts`, optimizers or the root
    modules a hand-written update trains (live_trained; None when there is none)."""
    import torch

    if not opts:
        return None
    counts = {"tensors": 0, "bytes": 0}
    optimizers = [o for o in opts if _is_optimizer(o)]
    modules = [o for o in opts if not _is_optimizer(o)]
    with torch.no_grad():
        digests = sorted([optimizer_digest(o, counts) for o in optimizers] + [module_digest(o, counts) for o in modules])
    return {"sha256": hashlib.sha256("".join(digests).encode()).hexdigest(), "optimizers": len(optimizers),
            "modules": len(modules), **counts}


class Weights:
    """The collector (auditor.capture.collectors): the digest at the end of the run, of the
    optimizers (else the trained root modules: live_trained) alive then and those found at the end
    of a step. A whole program's optimizers are gone by its end (its `__main__` is freed once it
    has run): they are looked for at the end of each step until some are found, and held until the
    digest is taken."""

    name = "weights"

    def __init__(self) -> None:
        self.held: list[Any] = []

    def install(self) -> None:
        pass

    def step_begin(self, index: int) -> None:
        pass

    def step_end(self, index: int) -> None:
        if not self.held:
            self.held = live_trained()
        return None

    def finish(self) -> dict[str, Any] | None:
        try:
            alive = live_trained()
            if self.held:  # (of the kind held: optimizers, or the modules of a program that had none)
                alive = [o for o in alive if _is_optimizer(o) == _is_optimizer(self.held[0])]
            return weights_digest(self.held + [o for o in alive if not any(o is h for h in self.held)])
        except Exception as e:  # (a tensor that cannot be read back: no digest, and why)
            return {"sha256": "", "optimizers": 0, "tensors": 0, "bytes": 0, "error": f"{type(e).__name__}: {e}"}
