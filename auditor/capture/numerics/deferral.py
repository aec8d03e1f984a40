"""Deferred checks of CPU calls, settled by the loss a backward pass starts from.

A CPU leaf call (one output, not float16) or a plain call the mode sees (not a hazard kind, not one
that writes into its arguments) is deferred: its tensors are kept unreduced and its place in the
step's op order held (its site found at once). When a backward pass starts, its loss settles them:
finite, and every deferred call counts as checked and is let go (NaN and Inf propagate to the
loss); not finite, and each is reduced then, before anything changes, so the origin is found as if
checked at once. (Misjudged: a value made before a backward pass and used only by a later loss of
the step.) A deferred output about to be written into is reduced first; the optimizer pre-hook and
the step's end reduce what is left; past DEFER_MAX_BYTES kept, calls are reduced at once. The first
LEARN_STEPS healthy steps and every LEARN_EVERY-th are reduced in full, where sites that make
non-finite values by design (a mask's -inf) are learned as benign. CPU only: on a GPU the kept
outputs would be device memory, and the checks are asynchronous kernels anyway.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from auditor.capture.numerics.stack import _checks_range, perf

MAX_OPS_PER_STEP = 20000  # records kept per step; later calls are counted as dropped
LEARN_STEPS, LEARN_EVERY = 3, 16  # healthy steps whose deferred calls are reduced anyway (see _settle)
DEFER_MAX_BYTES = 64 << 20  # deferred outputs kept at most (beyond it they are reduced at once)
_PENDING = None  # an `ops` slot held for a deferred call (see Deferral._defer)
_VERIFIED = ()  # ... that the loss showed finite, without a reduction of its own
COLLECTORS: weakref.WeakSet = weakref.WeakSet()  # the process's collectors (see hold_no_tensors)


def hold_no_tensors(on: bool) -> None:
    """While a rehearsed program records a memory history (auditor.capture.rehearsal.memory), the
    tensors it marks as the GPU's are the device memory its forecast counts: one kept for a
    deferred check would outlive the program's last use of it. On: what is kept is reduced now and
    nothing is deferred, as on a GPU; off: CPU calls are deferred again."""
    for c in list(COLLECTORS):
        c.defer_cpu = not on
        if on and c.deferred:
            try:
                c.resolve_deferred()
            except Exception as e:  # our bug must never become the user's failure
                c.failed(e)


class Deferral:
    """Mixin of Numerics: deferred CPU checks (see the module docstring)."""

    def _defer(self, resolve: Callable, payload: tuple, outs: Any) -> None:
        """Keep a CPU call's tensors instead of reducing them now: most of a step's checks, and
        all of their Python, are then never needed. The call's slot in `ops` keeps its place in
        execution order; `on_backward` settles it from the loss (`_settle`), a call about to
        overwrite its output reduces it first (`resolve_written`), and anything still pending at
        the optimizer step or the step's end is reduced then. `resolve(slot, *payload)` records it."""
        ops = self.ops
        if len(ops) >= MAX_OPS_PER_STEP:
            self.dropped += 1
            return
        i = len(self.deferred)
        self.deferred.append((len(ops), resolve, payload))
        ops.append(_PENDING)
        pending = self.pending
        for o in outs:
            # (a view is also written through its base: `h.mul_(...)` after `v = h.flatten()`)
            for key in (id(o),) if o._base is None else (id(o), id(o._base)):
                hit = pending.get(key)
                if hit is None:
                    pending[key] = [i]
                else:  # an in-place leaf (ReLU(inplace=True)) wrote into a deferred output
                    hit.append(i)
            self.deferred_bytes += o.nbytes
        if self.deferred_bytes > DEFER_MAX_BYTES:  # bounded: the kept tensors may outlive their use
            self.resolve_deferred()

    def _resolve(self, i: int) -> None:
        d = self.deferred[i]
        if d is None:
            return
        self.deferred[i] = None
        d[1](d[0], *d[2])

    def resolve_deferred(self) -> None:
        """Reduce every deferred call now, in execution order: as an eager check would have."""
        for i in range(len(self.deferred)):
            self._resolve(i)
        self._clear_deferred()

    def alias(self, src: Any, out: Any) -> None:
        """`out = src.data` / `src.detach()`: the same memory as `src`, but not a view of it, and
        `.data` does not even share its version counter. A write through `out` is a write into
        `src` (see resolve_written)."""
        if isinstance(out, torch.Tensor) and isinstance(src, torch.Tensor) and out is not src:
            self.aliases[id(out)] = (id(src),) if src._base is None else (id(src), id(src._base))

    def resolve_written(self, args: tuple, kwargs: dict) -> None:
        """A call is about to write into a tensor a deferred call made (`out += x`, `x[i] = v`,
        `relu_`): reduce that call first, while its output is still what it made. A write through
        an alias (`h.data[i] = v`) also forgets the statistics of `h`: its version did not move."""
        pending = self.pending
        aliases = self.aliases
        for t in (*args, *kwargs.values()):
            if isinstance(t, torch.Tensor):
                for u in (t, t._base):  # (a view writes into its base: `h[:, 0] += x`)
                    if u is None:
                        continue
                    ids = (id(u),)
                    if aliases:
                        ids += aliases.get(id(u), ())
                    for key in ids:
                        idx = pending.pop(key, None)
                        if idx is not None:
                            for i in idx:
                                self._resolve(i)
                        if key != ids[0]:  # (after the call that made it is reduced: it caches them)
                            self.cache.pop(key, None)

    def _settle(self, finite: bool) -> None:
        """The loss a backward pass starts from was computed from the deferred calls' outputs.
        Finite: they are taken as checked (a non-finite value made on the way would have reached
        the loss) and let go without a reduction.
        Not finite: each is reduced now, before the backward pass and the update change
        anything, and the step's origin is found among them as usual. They are reduced in a
        healthy step too, in the first LEARN_STEPS steps and every LEARN_EVERY-th: what makes
        non-finite values there by design (an attention mask's -inf) is learned as benign, so
        that a later step's origin is not blamed on it."""
        if finite and not (self.step < LEARN_STEPS or self.step % LEARN_EVERY == 0):
            for d in self.deferred:
                if d is not None:
                    self.ops[d[0]] = _VERIFIED
            self._clear_deferred()
        else:
            self.resolve_deferred()

    def _timed(self, fn: Callable, *args: Any) -> None:
        t0 = perf()
        with _checks_range():
            fn(*args)
        self.check_s += perf() - t0

    def _clear_deferred(self) -> None:
        self.deferred = []
        self.pending = {}
        self.deferred_bytes = 0
