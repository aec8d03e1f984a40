"""auditor.capture.one_call: a global module hook that takes itself out of torch's dict at an
outermost call sees none of the calls inside it, is back at its place in torch's order when the
call returns or raises, and the user's exception is the one that propagates."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.modules import module as nn_module

from auditor.capture.one_call import OneCall


class Twice(nn.Module):
    """Calls itself once inside its own call (depth), then its layers; raises on a 3-row batch."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 2))

    def forward(self, x, inner=False):
        if not inner:
            x = self(x, inner=True)
        if x.shape[0] == 3:
            raise ValueError("a 3-row batch")
        return self.body(x)


def test_a_hook_out_for_its_outermost_call_sees_that_call_alone_and_goes_back_in_its_place():
    seen, ends = [], []
    call = OneCall()
    before = nn_module.register_module_forward_pre_hook(lambda m, a: None)  # (another's, before ours)

    def hook(module, args):
        seen.append(type(module).__name__)
        assert call.watch(module, end, ((nn_module._global_forward_pre_hooks, handle.id, hook),))
        assert handle.id not in nn_module._global_forward_pre_hooks

    def end(module, args, output):
        ends.append(type(output).__name__)
        assert list(nn_module._global_forward_pre_hooks) == keys  # (back before the owner is told)

    handle = nn_module.register_module_forward_pre_hook(hook)
    after = nn_module.register_module_forward_pre_hook(lambda m, a: None)  # (another's, after ours)
    try:
        model = Twice()
        keys = list(nn_module._global_forward_pre_hooks)
        for _ in range(3):
            assert model(torch.ones(2, 2)).shape == (2, 2)
        # one outermost call each: the model's call of itself and its 3 layers unseen
        assert seen == ["Twice"] * 3 and ends == ["Tensor"] * 3
        assert list(nn_module._global_forward_pre_hooks) == keys and call.module is None
        assert not model._forward_pre_hooks and not model._forward_hooks and not model._forward_hooks_always_called
        with pytest.raises(ValueError, match="a 3-row batch"):  # (the user's own exception, unchanged)
            model(torch.ones(3, 2))
        assert seen == ["Twice"] * 4 and list(nn_module._global_forward_pre_hooks) == keys and call.module is None
        assert not model._forward_hooks and not model._forward_hooks_always_called
        model(torch.ones(2, 2))  # (and the hook works after a raise)
        assert seen == ["Twice"] * 5
    finally:
        for h in (before, handle, after):
            h.remove()


def test_a_hook_its_owner_switched_off_during_the_call_stays_out():
    call, on = OneCall(), {"on": True}

    def hook(module, args):
        call.watch(module, None, ((nn_module._global_forward_pre_hooks, handle.id, hook),), lambda: on["on"])
        on["on"] = False  # (as the step finder's hook, taken off by a step's end inside the call)

    handle = nn_module.register_module_forward_pre_hook(hook)
    try:
        Twice()(torch.ones(2, 2))
        assert handle.id not in nn_module._global_forward_pre_hooks and call.module is None
    finally:
        handle.remove()
