"""Values recorded during a step, read back once at its end, and their form on the wire."""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

_TB = torch._C.TensorBase


def num(x: float | None) -> float | str | None:
    """A float for JSON: non-finite values as "nan", "inf", "-inf" (JSON has no NaN)."""
    if x is None or math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _finite(lo: float, hi: float) -> bool:
    return math.isfinite(lo) and math.isfinite(hi)


class Values:
    """Values recorded during a step, by reference, for the host to read at its end.

    `add` returns a reference (an index into `vals`). A CPU tensor is read at once (reading costs
    no device sync there, and one `item` is cheaper than batching); a device tensor is kept and
    read back with the others of its device at the end of the step: one transfer per device, so
    checks cost no host sync while the step runs. `derive` adds a value computed on the host from
    an earlier one (the range of relu(x) from the range of x), which costs no device work at all."""

    def __init__(self) -> None:
        self.vals: list[Any] = []  # host values by reference; None until read for device tensors
        self.pending: dict[tuple, tuple[list, list]] = {}  # (device, dtype, vector) -> (tensors, refs)
        self.derived: list[tuple[int, int, Callable[[float], float]]] = []

    def __len__(self) -> int:
        return len(self.vals)

    def add(self, t: torch.Tensor) -> int:
        vals = self.vals
        ref = len(vals)
        if t.is_cpu:
            vals.append(_TB.item(t) if t.dim() == 0 else _TB.tolist(t.double()))
            return ref
        vals.append(None)
        key = (t.device, t.dtype, t.dim() > 0)
        g = self.pending.get(key)
        if g is None:
            g = self.pending[key] = ([], [])
        g[0].append(t)
        g[1].append(ref)
        return ref

    def add_range(self, lo: torch.Tensor | float, hi: torch.Tensor | float) -> int:
        """min at the returned reference, max at the next. Host floats (a CPU weight's range kept
        from an earlier step) are stored as they are."""
        if type(lo) is float:
            vals = self.vals
            ref = len(vals)
            vals.append(lo)
            vals.append(hi)
            return ref
        if lo.is_cpu:
            vals = self.vals
            ref = len(vals)
            vals.append(_TB.item(lo))
            vals.append(_TB.item(hi))
            return ref
        ref = self.add(lo)
        self.add(hi)
        return ref

    def add_host(self, value: Any) -> int:
        """A value already on the host."""
        self.vals.append(value)
        return len(self.vals) - 1

    def derive(self, source: int, fn: Callable[[float], float]) -> int:
        """A value computed at read time as fn(value of `source`)."""
        ref = len(self.vals)
        self.vals.append(None)
        self.derived.append((ref, source, fn))
        return ref

    def read(self) -> list[Any]:
        vals = self.vals
        by_device: dict[torch.device, list[tuple]] = {}
        for key, (tensors, refs) in self.pending.items():
            by_device.setdefault(key[0], []).append((key, tensors, refs))
        for device, groups in by_device.items():
            wide = torch.float32 if device.type == "mps" else torch.float64
            parts = [_TB.to(torch.cat([t.reshape(-1) for t in ts]) if key[2] else torch.stack(ts), wide)
                     for key, ts, _ in groups]
            # one transfer per device; TensorBase's own tolist: the probes' sync wrappers on Tensor
            # are for the user's calls
            flat = _TB.tolist(torch.cat(parts) if len(parts) > 1 else parts[0])
            off = 0
            for (key, ts, refs), part in zip(groups, parts):
                if key[2]:
                    for t, ref in zip(ts, refs):
                        n = t.numel()
                        vals[ref] = flat[off:off + n]
                        off += n
                else:
                    for ref in refs:
                        vals[ref] = flat[off]
                        off += 1
        self.pending = {}
        for ref, source, fn in self.derived:  # in order: a derived value may build on an earlier one
            vals[ref] = fn(vals[source])
        self.derived = []
        return vals




def _scalar(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.detach().cpu().item() if v.device.type == "cpu" else None  # never sync a device here
    if isinstance(v, float):
        return num(v)
    return v if isinstance(v, (int, bool, str)) or v is None else None


def _plain(d: dict) -> dict[str, Any]:
    """The scalar (and tuple-of-scalar) entries of a settings dict, JSON-ready."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, (list, tuple)) and len(v) <= 64 and all(isinstance(x, (int, float, bool)) for x in v):
            out[str(k)] = [_scalar(x) for x in v]
        elif not isinstance(v, (list, tuple, dict)):
            s = _scalar(v)
            if s is not None:
                out[str(k)] = s
    return out
