"""Torch's own optimizer updates: while one runs, the Tensor methods' probes pass every call on at
once (its per-parameter `step.item()` reads are torch's, not the user's); a closure it is given
runs probed."""
from __future__ import annotations

import inspect
from itertools import chain
from typing import Any, Callable

from torch.optim import optimizer as _optimizer

from auditor.capture.frames import is_torch_internal


# A built-in optimizer's update reads each parameter's step counter with `.item()` (torch.optim's
# `_get_value`, of a host tensor: no sync), as many calls a step as the model has parameters, each
# looked at by its probe (its caller's frame, code and file) at ~0.5-1 us: 1-2% of a host-bound
# step. So while an update of torch's own code runs (its class's `step` is torch's, with no hook
# but ours around it), the Tensor methods' probes pass every call on at once; a closure it is given
# (LBFGS's, Lightning's) is the user's forward and backward, and runs probed. A flag the probes
# read, not the methods swapped back on the class: setting an attribute of torch.Tensor would
# invalidate what CPython cached of every Tensor attribute, at every site, twice a step. (The
# process's flag: a call another thread makes during the update is passed on too.)
_aside = [0, False]  # [updates begun and not ended (nested ones counted), whether the probes pass calls on]
_TORCH_STEP: dict[type, bool] = {}  # optimizer class -> its step is torch's own code
_MINE = object()  # (_torch_update: a step whose code is not all torch's)
_OURS_ONLY: dict[tuple, bool] = {}  # the ids of torch's global optimizer hooks -> they are all the auditor's


def _torch_update(opt: Any, args: tuple, kwargs: dict) -> Any:
    """_MINE where the user's code may run inside this optimizer step outside a closure (see
    _aside); else its closure, or None."""
    cls = type(opt)
    own = _TORCH_STEP.get(cls)
    if own is None:
        try:
            code = getattr(inspect.unwrap(cls.step), "__code__", None)  # (torch wraps step to run the hooks)
        except (AttributeError, ValueError):  # (no step of its own to read, or wrappers in a cycle)
            code = None
        own = _TORCH_STEP[cls] = code is not None and is_torch_internal(code.co_filename)
    if not own or len(args) > 2 or (kwargs and (len(kwargs) > 1 or "closure" not in kwargs)):
        return _MINE
    if getattr(opt, "_optimizer_step_pre_hooks", None) or getattr(opt, "_optimizer_step_post_hooks", None):
        return _MINE
    pre, post = _optimizer._global_optimizer_pre_hooks, _optimizer._global_optimizer_post_hooks
    key = (*pre, None, *post)  # (the hooks' ids: a hook registered since has a new one)
    ours = _OURS_ONLY.get(key)
    if ours is None:
        ours = _OURS_ONLY[key] = all(getattr(h, "__module__", "").startswith("auditor.")
                                     for h in chain(pre.values(), post.values()))
    if not ours:
        return _MINE
    closure = kwargs["closure"] if "closure" in kwargs else args[1] if len(args) > 1 else None
    return closure if callable(closure) else None


def update_begins(opt: Any, args: tuple, kwargs: dict) -> tuple | None:
    """An optimizer step's pre-hooks are done (called by the last of ours): see _aside. Returns the
    step's arguments with its closure made to run probed, where it has one."""
    depth = _aside[0]
    _aside[0] = depth + 1
    if depth == 0:
        closure = _torch_update(opt, args, kwargs)
        if closure is not _MINE:
            _aside[1] = True
            if closure is not None:
                probed = _probed(closure)
                if "closure" in kwargs:
                    return args, {**kwargs, "closure": probed}
                return (args[0], probed, *args[2:]), kwargs
    elif _aside[1] and _torch_update(opt, args, kwargs) is not None:  # (the user's code, in torch's update)
        _aside[1] = False
    return None


def update_ends() -> None:
    """An optimizer step has returned (called by the first of our post-hooks)."""
    if _aside[0]:
        _aside[0] -= 1
    if _aside[0] == 0:
        _aside[1] = False


def _probed(closure: Callable) -> Callable:
    """`closure`, run with the probes looking (the user's forward and backward, inside an update)."""
    def closure_probed():
        aside, _aside[1] = _aside[1], False
        try:
            return closure()
        finally:
            _aside[1] = aside and _aside[0] > 0  # (still inside the update)
    return closure_probed
