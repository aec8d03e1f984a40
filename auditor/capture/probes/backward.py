"""Backward passes: each one the user's code starts, timed at its line (anomaly mode on or not),
its readers told first; a retained graph (retain_graph=True) watched for whether a later backward
uses it, and how many are alive at once."""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from auditor.capture.frames import user_frame
from auditor.capture.probes.graph_use import graph_of
from auditor.capture.probes.recorder import NOTED, REC, FrameKey, Recorder, settle_traced_steps
from auditor.capture.probes.wrappers import _compiling, _user_call, _wrap, perf
from auditor.evidence import model as m


_anomaly_enabled = torch.is_anomaly_enabled


def _watch_retained(rec: Recorder, roots: list[Any], what: str, where: FrameKey) -> None:
    """Hook every node of a retained graph: if no later backward runs through it before the step
    ends, the graph was kept alive for nothing."""
    n = rec.retain_sampled.get(where, 0)
    rec.retain_sampled[where] = n + 1
    nodes, saved, read_all = graph_of(roots, measure=n < 3)
    used = [False]
    alive = _watch_lifetime(rec, roots, where)

    def hook(*_: Any) -> None:
        used[0] = True

    for node in nodes:
        if type(node).__name__ == "AccumulateGrad":
            continue  # shared by every graph over the same parameters: says nothing about reuse
        try:
            node.register_prehook(hook)
        except (RuntimeError, AttributeError):
            pass
    rec.retain_events.append({"what": what, "where": where, "used": used, "nodes": len(nodes), "saved_bytes": saved,
                              "saved_partial": not read_all, "alive": alive})


class _Lifetime:
    """Kept in a graph's root node (its `metadata` dict): freed with the graph, when the loss that
    held it is dropped or reassigned. Counting these tells how many retained graphs, and so how
    many copies of their saved activations, were alive at once."""

    __slots__ = ("__weakref__",)


def _watch_lifetime(rec: Recorder, roots: list[Any], where: FrameKey) -> int | None:
    """Count this retained graph alive at `where` until its root node is freed; return how many
    graphs retained there are alive now (None when the node takes no metadata)."""
    root = next((r for r in roots if r is not None), None)
    if root is None:
        return None
    token = _Lifetime()
    try:
        root.metadata["auditor.retained"] = token
    except (AttributeError, RuntimeError, TypeError):
        return None
    live = rec.retain_alive
    live[where] = live.get(where, 0) + 1
    weakref.finalize(token, _graph_freed, live, where)
    return live[where]


def _graph_freed(live: dict, where: FrameKey) -> None:
    live[where] = live.get(where, 1) - 1


def _roots(tensors: Any) -> list[Any]:
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    return [t.grad_fn for t in tensors if isinstance(t, torch.Tensor)]


def _backward_probe(what: str, tensors_of: Callable[..., Any]):
    def make(orig):
        def probe(*args, **kwargs):
            if _compiling():
                return orig(*args, **kwargs)
            rec = REC
            if rec.active:
                f = _user_call()
                if f is not None:
                    if NOTED:  # (before this backward pass changes their gradients)
                        settle_traced_steps()
                    for start in _BACKWARD_STARTS:
                        start(what, tensors_of(*args, **kwargs))
                    for read in _BACKWARD_READERS:
                        read(args, kwargs)
                    where = user_frame(f)
                    retain = kwargs.get("retain_graph")
                    if retain is None:
                        retain = kwargs.get("create_graph", False)
                    anomaly = _anomaly_enabled()  # (a flag read: the only cost on this path)
                    t0 = perf()
                    result = orig(*args, **kwargs)
                    rec.add(m.BACKWARD, what, where, (perf() - t0) * 1e3, retain_graph=bool(retain))
                    if anomaly:
                        rec.add(m.ANOMALY_ON, m.ANOMALY_BACKWARD, where)
                    if retain:
                        _watch_retained(rec, _roots(tensors_of(*args, **kwargs)), what, where)
                    return result
            return orig(*args, **kwargs)
        return probe
    return make


_BACKWARD_READERS: list[Callable[[tuple, dict], None]] = []


def read_backward_calls(reader: Callable[[tuple, dict], None]) -> None:
    """Have `reader(args, kwargs)` called with the arguments of each backward pass the user's code
    starts (`loss.backward()`, `torch.autograd.backward`, `torch.autograd.grad`) outside compiled
    code, before it runs."""
    _BACKWARD_READERS.append(reader)


_BACKWARD_STARTS: list[Callable[[str], None]] = []


def on_backward_start(reader: Callable[[str, Any], None]) -> Callable[[], None]:
    """Have `reader(what, tensors)` called as each backward pass the user's code starts outside compiled
    code begins ("Tensor.backward", "torch.autograd.backward", "torch.autograd.grad"; `tensors`: what
    it differentiates, a tensor or a sequence of them, as passed), before the
    probe times it: a step boundary crossed there puts the pass in the new step. (A wrapper of
    its own around backward would be the probe's caller, which the probe takes for torch's or
    the auditor's own call, and leaves untallied.) Returns the undo."""
    _BACKWARD_STARTS.append(reader)
    return lambda: _BACKWARD_STARTS.remove(reader) if reader in _BACKWARD_STARTS else None


def _install_backward_probes() -> None:
    first = lambda *a, **k: a[0] if a else next(iter(k.values()), None)  # noqa: E731
    _wrap(torch.Tensor, "backward", _backward_probe("Tensor.backward", first))
    _wrap(torch.autograd, "backward", _backward_probe(
        "torch.autograd.backward", lambda *a, **k: a[0] if a else k.get("tensors")))
    _wrap(torch.autograd, "grad", _backward_probe(
        "torch.autograd.grad", lambda *a, **k: a[0] if a else k.get("outputs")))
