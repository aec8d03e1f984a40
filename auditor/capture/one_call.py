"""One outermost module call made without the auditor's global module hooks in it.

A global module hook (torch.nn.modules.module.register_module_forward_pre_hook) sends every module
call through torch's slow path and runs at each of them, nested calls included (~10-40 us a call
of a small network on a 2-core machine). Where only the outermost call of a forward matters (its
time, where a step ends), the hook takes itself out of torch's dict at that call and puts itself
back when the call ends: `OneCall` tells that end with a forward pre-hook and an always-called
forward hook of the module's own, under a key of ours, which count the module's calls of itself
(torch runs always-called hooks when the forward raises too), and puts the global hooks it took out
back in their places in torch's order before it tells the call's owner. Torch reads its global
hooks into a tuple before running them, so a hook may take itself out while they run."""
from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Any, Callable, Sequence

from torch.utils.hooks import RemovableHandle


_COMPILED: list[bool] = [False]  # (once torch.compile has compiled a frame, taken to have for good: after a
# torch._dynamo.reset() the hooks stay in for every call, the safe side)


def compiled_anything() -> bool:
    """Whether torch.compile has compiled a frame in this process (dynamo's own count). Its guards
    may read the global hooks: once it has, a hook no longer takes itself out (a change between
    two calls would recompile)."""
    if _COMPILED[0]:
        return True
    u = sys.modules.get("torch._dynamo.utils")
    frames = getattr(u, "counters", {}).get("frames") if u is not None else None
    _COMPILED[0] = bool(frames and frames.get("total"))
    return _COMPILED[0]


def order_of(d: OrderedDict, key: int) -> list | None:
    """The keys of torch's hook dict `d` before `key` is taken out of it: None where it is last
    (most often: it goes back at the end)."""
    return None if next(reversed(d), None) == key else list(d)


def put_back(d: OrderedDict, key: int, hook: Callable, order: list | None) -> None:
    """`hook` back into torch's hook dict `d` under `key`, at its place in `order` (order_of's)."""
    if key in d:
        return
    d[key] = hook
    if order is None:  # (it was last: it is again)
        return
    rank = {k: n for n, k in enumerate(order)}
    for k in sorted(d, key=lambda k: rank.get(k, len(order))):
        d.move_to_end(k)


class OneCall:
    """The end of one outermost module call: `watch(module, on_end, out)` takes the global hooks in
    `out` out of torch's dicts and puts the module's own hooks on; when the call returns or raises,
    once those are off, the global hooks go back where they were (unless `back()` says their owner
    switched them off meanwhile) and `on_end(module, args, output)` runs."""

    def __init__(self) -> None:
        self.key = RemovableHandle(OrderedDict()).id  # (an id no handle has)
        self.module: Any = None
        self.depth = 0
        self.on_end: Callable[[Any, Any, Any], None] | None = None
        self.out: list[tuple[OrderedDict, int, Callable, list | None]] = []
        self.back: Callable[[], bool] | None = None

    def watch(self, module: Any, on_end: Callable[[Any, Any, Any], None] | None,
              out: Sequence[tuple[OrderedDict, int, Callable]] = (), back: Callable[[], bool] | None = None) -> bool:
        """Watch `module`'s call that is running now, with each (torch's hook dict, key, hook) of
        `out` out of its dict for the call; False, and nothing taken out, where the module has no
        always-called forward hooks (torch before 2.2: its end would not be told on a raise) or a
        call is watched already."""
        if self.module is not None:
            return False
        key = self.key
        try:
            always = module._forward_hooks_always_called
            module._forward_pre_hooks[key] = self._nested
            module._forward_hooks[key] = self._end
            always[key] = True
        except AttributeError:
            for d in ("_forward_pre_hooks", "_forward_hooks"):
                getattr(module, d, {}).pop(key, None)
            return False
        self.module, self.depth, self.on_end, self.back = module, 0, on_end, back
        self.out = [(d, k, hook, order_of(d, k)) for d, k, hook in out]
        for d, k, _, _ in self.out:
            d.pop(k, None)
        return True

    def _nested(self, module: Any, args: Any) -> None:
        self.depth += 1  # (the module called inside its own call)

    def _end(self, module: Any, args: Any, output: Any) -> None:
        if self.depth:
            self.depth -= 1
            return
        on_end = self.on_end
        self.drop()
        if on_end is not None:
            on_end(module, args, output)

    def drop(self) -> None:
        """The module's hooks off and the global ones back (the call ended, or the watch is given up)."""
        key, mod, self.module, self.on_end = self.key, self.module, None, None
        if mod is not None:
            mod._forward_pre_hooks.pop(key, None)
            mod._forward_hooks.pop(key, None)
            mod._forward_hooks_always_called.pop(key, None)
        out, back, self.out, self.back = self.out, self.back, [], None
        if out and (back is None or back()):
            for d, k, hook, order in out:
                put_back(d, k, hook, order)
