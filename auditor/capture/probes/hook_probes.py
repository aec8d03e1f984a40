"""Probes on hook registrations (a tensor's or a module's): how many hooks of a kind the tensor or
module holds after each one registered at the user's line. Hooks registered in the step on the
same parameters every step pile up (hook-leak)."""
from __future__ import annotations

from typing import Any, Callable

import torch

from auditor.capture.frames import user_frame
from auditor.capture.unseen import no_torch_function


def _hook_probe(what: str, hooks: str, recorder: Callable[[], Any], user_call: Callable[[], Any]):
    """A probe on a hook registration: tallied at the user's line with how many hooks of that kind
    the tensor or module holds after it (its `hooks` dict). A hook registered in the step on the
    same parameters every step piles up, and every backward pass runs them all: the step slows
    down, and its time grows in the backward, not at the line that adds them. Registrations are
    rare (setup, or once per step on a new activation), so the probe costs nothing on the path
    every call takes."""
    def make(orig):
        def probe(self, *args, **kwargs):
            handle = orig(self, *args, **kwargs)
            rec = recorder()
            if rec.active and not rec.in_data:
                f = user_call()  # (the probe's caller, if the user's)
                if f is not None:
                    with no_torch_function():  # (the auditor's read: the user's modes see the call only)
                        held = getattr(self, hooks, None)
                        n = len(held) if held is not None else 0
                    rec.hook_added(what, user_frame(f), self, n)
            return handle
        return probe
    return make


_TENSOR_HOOKS = (("register_hook", "_backward_hooks"),
                 ("register_post_accumulate_grad_hook", "_post_accumulate_grad_hooks"))
_MODULE_HOOKS = (("register_forward_hook", "_forward_hooks"), ("register_forward_pre_hook", "_forward_pre_hooks"),
                 ("register_full_backward_hook", "_backward_hooks"),
                 ("register_full_backward_pre_hook", "_backward_pre_hooks"),
                 ("register_backward_hook", "_backward_hooks"))


def install_hook_probes(wrap: Callable, recorder: Callable[[], Any], user_call: Callable[[], Any]) -> None:
    """The probes put on with `wrap(owner, name, make)` (auditor.capture.probes's), reading the
    process's recorder `recorder()` and the probe's caller `user_call()` (None where not the user's)."""
    for name, hooks in _TENSOR_HOOKS:
        if hasattr(torch.Tensor, name):
            wrap(torch.Tensor, name, _hook_probe(f"Tensor.{name}", hooks, recorder, user_call))
    for name, hooks in _MODULE_HOOKS:
        if hasattr(torch.nn.Module, name):
            wrap(torch.nn.Module, name, _hook_probe(f"Module.{name}", hooks, recorder, user_call))
