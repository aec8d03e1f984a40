"""The tensors an autograd node saved for its backward, read without unpacking them.

Reading a node's `_saved_*` attribute unpacks the saved value. Where saved-tensor hooks packed it
(activation checkpointing, `torch.autograd.graph.save_on_cpu`), unpacking runs the program's unpack
hook: checkpointing recomputes the forward (the user's `forward` runs again, inside the audit), and
`save_on_cpu` copies back to the device. The audit must not do either. So:

- where this torch gives a saved value's packed form (`node._raw_saved_x.data`, torch 2.5 and
  later), that is read: a tensor is measured, anything a hook packed (checkpointing's holder, a
  (device, CPU copy) pair) is not, and the node's reading is incomplete;
- where it does not (torch 2.4), `_saved_*` is read only while no saved-tensor hooks have been
  entered in this process (`noting_entered`, on `saved_tensors_hooks.__enter__`, notes the first);
  after that nothing is read, and every reading is incomplete.

A reading that is incomplete says so (`Saved.complete`): its bytes are a lower bound.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

_names: dict[type, tuple[str, ...]] = {}  # per node type: its saved slots' names, without the prefix


class _Hooks:
    """Whether a saved-tensor hook has been entered in this process (read on torch without `.data`)."""
    entered = False


def _has_packed_form() -> bool:
    x = torch.ones(1, requires_grad=True)
    raw = getattr((x * x).grad_fn, "_raw_saved_self", None)
    return raw is not None and hasattr(raw, "data")


PACKED_FORM = _has_packed_form()


def noting_entered(orig: Any) -> Any:
    """`saved_tensors_hooks.__enter__` that notes the first saved-tensor hooks entered (probes.install
    puts it on torch without the packed form)."""
    def enter(self: Any) -> Any:
        _Hooks.entered = True
        return orig(self)
    return enter


class Saved(NamedTuple):
    tensors: list[torch.Tensor]
    complete: bool  # False: some saved values were packed by hooks (or could not be read safely)


def saved_of(node: Any) -> Saved:
    """The tensors `node` saved for its backward, none of them unpacked (see the module docstring).
    A node whose saved tensors a backward freed has none."""
    names = _names.get(type(node))
    if names is None:
        names = _names[type(node)] = tuple(n[len("_raw_saved_"):] for n in dir(type(node))
                                           if n.startswith("_raw_saved_"))
    if not names:
        return Saved([], True)
    if not PACKED_FORM:
        if _Hooks.entered:
            return Saved([], False)
        return _unpacked(node, names)
    out: list[torch.Tensor] = []
    complete = True
    for n in names:
        try:
            raw = getattr(node, "_raw_saved_" + n)
        except RuntimeError:  # (freed by a backward that ran, which frees all of a node's saved tensors)
            return Saved([], True)
        except AttributeError:
            continue
        for r in raw if isinstance(raw, (tuple, list)) else (raw,):
            try:
                v = r.data
            except RuntimeError:  # (freed)
                return Saved([], True)
            except AttributeError:  # (not a saved tensor: a size or a scalar)
                continue
            if isinstance(v, torch.Tensor):
                out.append(v)
            elif v is not None:
                complete = False  # (packed by a hook: not read)
    return Saved(out, complete)


def _unpacked(node: Any, names: tuple[str, ...]) -> Saved:
    """Torch 2.4: `_saved_*` read while no hooks were ever entered, so nothing is unpacked by a hook."""
    out: list[torch.Tensor] = []
    for n in names:
        try:
            v = getattr(node, "_saved_" + n)
        except RuntimeError:
            return Saved([], True)
        except AttributeError:
            continue
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return Saved(out, True)
