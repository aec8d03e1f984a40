"""A process that calls torch as a test asks, with or without the auditor's probes and stand-ins
installed, and answers what each call returned or raised (tests/capture/test_probes_accept_torch.py).

    python probe_server.py plain|probes|rehearsal|numerics

Each request is one line of JSON: [op, args, kwargs], the values as specs that this process builds
(so tensors are made where the call runs). Each answer is one line of JSON: the call's normalised
result, or ["E", exception type, whether the auditor's code raised it]. The first answer lists the
callables the auditor wrapped here (owner.name).
"""
from __future__ import annotations

import json
import math
import sys
import traceback
import types

import numpy as np
import torch

SETUP = sys.argv[1]
if SETUP in ("probes", "rehearsal", "numerics"):
    from auditor.capture import cuda_standins, probes

    if SETUP == "rehearsal":
        from auditor.capture import rehearsal

        assert rehearsal.install("on", None)
    rec = probes.install()
    if SETUP == "numerics":
        from auditor.capture.numerics import collector

        collector.Numerics().install()
    if SETUP != "rehearsal":
        cuda_standins.install(lambda: probes.REC)
    assert rec.active

import importlib.util
import os

AUDITOR_DIR = os.path.realpath(importlib.util.find_spec("auditor").submodule_search_locations[0]) + os.sep


class Sub(torch.Tensor):
    """A user's tensor subclass: torch hands it to every op as a tensor."""


OWNERS = {"torch": torch, "torch.Tensor": torch.Tensor, "torch.cuda": torch.cuda, "torch.cuda.memory": torch.cuda.memory, "torch.autograd": torch.autograd,
          "torch.nn.functional": torch.nn.functional, "torch.accelerator": getattr(torch, "accelerator", None)}


def wrapped() -> list[str]:
    """Every callable on the owners above that is the auditor's (a probe or a stand-in)."""
    out = []
    for owner_name, owner in OWNERS.items():
        if owner is None:
            continue
        for name, value in list(vars(owner).items()):
            code = getattr(value, "__code__", None) if isinstance(value, types.FunctionType) else None
            if code is not None and os.path.realpath(code.co_filename).startswith(AUDITOR_DIR):
                out.append(f"{owner_name}.{name}")
    return sorted(out)


def build(spec):
    kind, v = spec
    if kind == "py":
        return v
    if kind == "t0":
        return torch.tensor(v)
    if kind == "t1":
        return torch.tensor(v, dtype=torch.float32)
    if kind == "ti":
        return torch.tensor(v, dtype=torch.int64)
    if kind == "tb":
        return torch.tensor(v, dtype=torch.bool)
    if kind == "param":
        return torch.nn.Parameter(torch.tensor(v, dtype=torch.float32))
    if kind == "sub":
        return torch.tensor(v, dtype=torch.float32).as_subclass(Sub)
    if kind == "dtype":
        return getattr(torch, v)
    if kind == "list":
        return [build(s) for s in v]
    if kind == "tuple":
        return tuple(build(s) for s in v)
    raise ValueError(kind)


def norm(x):
    if isinstance(x, torch.Tensor):
        with torch.no_grad():
            vals = x.detach().reshape(-1).tolist() if x.device.type != "meta" else []
        return ["T", type(x).__name__, str(x.dtype), list(x.shape), [repr(v) for v in vals]]
    if isinstance(x, np.ndarray):
        return ["N", str(x.dtype), list(x.shape), [repr(v) for v in x.reshape(-1).tolist()]]
    if isinstance(x, (list, tuple)):
        return [type(x).__name__, [norm(v) for v in x]]
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return ["other", type(x).__name__]


def resolve(op: str):
    """The callable named `op` as this process has it (wrapped or plain)."""
    if op in SPECIAL:
        return SPECIAL[op]
    owner_name, _, name = op.rpartition(".")
    owner = OWNERS[owner_name]
    attr = getattr(owner, name)
    if owner is torch.Tensor:
        return lambda self, *a, **k: attr(self, *a, **k)
    return attr


SPECIAL = {
    # plain torch calls whose arguments the wrapped methods can reach (a 0-d tensor where a number
    # goes, tensors in lists): the audit must not change what they accept
    "torch.tensor": lambda *a, **k: torch.tensor(*a, **k),
    "torch.as_tensor": lambda *a, **k: torch.as_tensor(*a, **k),
    "torch.stack": lambda *a, **k: torch.stack(*a, **k),
    "np.asarray": lambda *a, **k: np.asarray(*a, **k),
    "getitem": lambda t, i: t[i],
    "len": lambda *a: len(*a),
    "list": lambda *a: list(*a),
    "float": lambda *a: float(*a),
    "int": lambda *a: int(*a),
    "bool": lambda *a: bool(*a),
    "format": lambda x, *a: format(x, ".3f") if not a else format(x, *a),
    "str": lambda *a: str(*a),
    "range_index": lambda i: range(10)[i],
    "torch.zeros": lambda *a, **k: torch.zeros(*a, **k),
}


def answer(op, args, kwargs):
    try:
        f = resolve(op)
        a = [build(s) for s in args]
        k = {key: build(s) for key, s in kwargs.items()}
        return norm(f(*a, **k))
    except BaseException as e:  # noqa: BLE001 (what was raised is the answer)
        frames = traceback.extract_tb(e.__traceback__)
        own = bool(frames) and os.path.realpath(frames[-1].filename).startswith(AUDITOR_DIR)
        return ["E", type(e).__name__, own]


# The requests and answers travel on descriptors of their own: a call handed 0 or 1 as a file
# (open(0, "wb")) reaches /dev/null, not the conversation.
requests = os.fdopen(os.dup(0), "r")
answers = os.fdopen(os.dup(1), "w")
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 0)
os.dup2(null, 1)
print(json.dumps(wrapped()), file=answers, flush=True)
for line in requests:
    op, args, kwargs = json.loads(line)
    print(json.dumps(answer(op, args, kwargs)), file=answers, flush=True)
