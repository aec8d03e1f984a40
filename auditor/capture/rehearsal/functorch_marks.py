"""CUDA rehearsal under torch.func: the GPU mark goes with a tensor through the transforms' own
wrapping and unwrapping, which no torch function sees."""
from __future__ import annotations

import sys
from typing import Any, Callable

import torch

# torch.func's transforms (vmap, grad, vjp, jacrev, functionalize) wrap each input in a new tensor
# object for the transform's level and unwrap each result into another, in C++: no torch function
# sees either, so the mark stayed behind on the caller's tensor.
_FUNCTORCH_WRAPPERS = {
    "torch._functorch.vmap": ("_add_batch_dim", "_remove_batch_dim"),
    "torch._functorch.eager_transforms": ("_wrap_for_grad", "_unwrap_for_grad", "_wrap_functional_tensor",
                                          "_unwrap_functional_tensor"),
    "torch._functorch.autograd_function": ("_add_batch_dim", "_wrap_for_grad", "_unwrap_for_grad"),
}


def install_functorch_marks(CUDA_MARK: str) -> None:
    """A tensor that torch.func wraps or unwraps keeps its mark: per-sample gradients made with
    `vmap(grad(f))` from GPU weights and a GPU batch are GPU tensors, as on a GPU. Without this
    the function would see unmarked (host) copies of its GPU inputs and return unmarked results:
    the first op mixing them with the program's GPU tensors would be refused as a device mix that
    a GPU runs (exit 3 at step 0). CUDA_MARK: the mark's attribute name (rehearsal.device's)."""
    for module_name, names in _FUNCTORCH_WRAPPERS.items():
        module = sys.modules.get(module_name)
        for name in names:
            orig = getattr(module, name, None)
            if orig is None or hasattr(orig, "__rehearsal_original__"):
                continue

            def keep_mark(t: Any, *args: Any, __orig: Callable = orig, **kwargs: Any) -> Any:
                out = __orig(t, *args, **kwargs)
                if out is not t and isinstance(out, torch.Tensor) and getattr(t, CUDA_MARK, False):
                    setattr(out, CUDA_MARK, True)
                return out

            keep_mark.__rehearsal_original__ = orig  # type: ignore[attr-defined]
            setattr(module, name, keep_mark)
