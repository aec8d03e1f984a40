"""Whether the autograd graph an outermost forward pass records is ever used by a backward pass.

A forward under grad mode records a graph and keeps what its backward would need (the saved
activations) until the graph is freed. A forward whose graph no backward pass runs through (a
reinforcement learner choosing its action, an evaluation loop, a target network's forward, all
outside `torch.no_grad()`) pays for both for nothing.

At the end of a watched outermost forward with grad enabled, one small object (`_Use`) is put
into the pre-hooks of the graph's output nodes: a backward pass through any of them marks it used,
and it is freed with the last of them, when the graph is (after its backward, or when the tensors
that held it are dropped). Its `__del__` only appends the verdict to VERDICTS, which the Recorder
folds into its tallies at its next drain (m.GRAPH_USE at the forward's line, "used" or "unused").
A graph never freed (kept in a list for good) gives no verdict: graph-leak's scans see those.

Which forwards are watched: those outside the steps (setup, an evaluation, a rollout between
updates) and those in the steps the numerics checks or the line sampler look at (Watch.on, set by
the step session): a timed step carries nothing of this. Its saved tensors are not measured.

`graph_of` walks a graph's nodes, and measures its saved tensors where asked (never unpacking them:
`saved_tensors`): retained-graph's reading of a graph kept with `retain_graph=True` (backward.py).
"""
from __future__ import annotations

from typing import Any

import torch

from auditor.capture.saved_tensors import saved_of
from auditor.capture.unseen import no_torch_function
from auditor.evidence import model as m

FrameKey = tuple[str, int, str] | None
VERDICTS: list[tuple[FrameKey, bool]] = []  # (line, used) of the graphs freed since the last fold
_ROOTS_AT_MOST = 8  # output tensors whose nodes are hooked (a dict of many outputs: the first ones)


class Watch:
    """Whether forwards are watched now (the step session sets it at each step's start and end)."""
    on = True


class _Use:
    """In the pre-hooks of a forward's output nodes: called when a backward pass runs through one,
    freed with the last of them."""

    __slots__ = ("where", "used")
    verdicts = VERDICTS  # (read through the class: at the interpreter's exit the module's globals may be gone)

    def __init__(self, where: FrameKey) -> None:
        self.where, self.used = where, False

    def __call__(self, *_: Any) -> None:
        self.used = True

    def __del__(self) -> None:
        try:
            self.verdicts.append((self.where, self.used))
        except Exception:  # (a graph freed at the interpreter's exit: nothing is left to tell)
            pass


def _outputs(output: Any) -> list[torch.Tensor]:
    """The tensors a module returned: itself, a tuple/list's or a mapping's (a ModelOutput) items."""
    if isinstance(output, torch.Tensor):
        return [output]
    items = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return [t for t in items if isinstance(t, torch.Tensor)][:_ROOTS_AT_MOST]


def graph_of(roots: list[Any], measure: bool) -> tuple[list[Any], int, bool]:
    """Autograd nodes reachable from `roots`, the bytes their saved tensors hold (if measured), read
    without unpacking them (`saved_tensors.saved_of`), and whether every saved value was read (False:
    some were packed by saved-tensor hooks, activation checkpointing's, and the bytes are a lower bound)."""
    seen: dict[int, Any] = {}
    stack = [r for r in roots if r is not None]
    saved: dict[int, int] = {}
    complete = True
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        if measure:
            tensors, read_all = saved_of(node)
            complete = complete and read_all
            for v in tensors:
                if not v.numel():
                    continue
                try:
                    storage = v.untyped_storage()
                except (NotImplementedError, RuntimeError):  # (a wrapper subclass: a rehearsal's)
                    continue
                saved[storage.data_ptr()] = storage.nbytes()
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return list(seen.values()), sum(saved.values()), complete


def watch(module: Any, output: Any, where: FrameKey) -> None:
    """Watch the graph of `module`'s outermost call at `where`, which returned `output` with grad
    mode on (see the module docstring)."""
    with no_torch_function():  # (the auditor's reads: the user's modes see the user's calls only)
        _watch(module, output, where)


def _watch(module: Any, output: Any, where: FrameKey) -> None:
    roots = {id(n): n for t in _outputs(output) if (n := t.grad_fn) is not None}
    if not roots:
        return  # (no graph: a frozen model on inputs that need no grad)
    use = _Use(where)
    hooked = False
    for node in roots.values():
        try:
            node.register_prehook(use)
            hooked = True
        except (RuntimeError, AttributeError, TypeError):
            pass
    if not hooked:
        use.where = None  # (in no node: freed now, it tells nothing)


def fold(add: Any) -> None:
    """The verdicts since the last fold, each through `add(kind, what, where)` (the Recorder's):
    "used" or "unused" at the forward's line."""
    if not VERDICTS:
        return
    taken = VERDICTS[:]
    del VERDICTS[:len(taken)]
    for where, used in taken:
        if where is not None:
            add(m.GRAPH_USE, "used" if used else "unused", where)
