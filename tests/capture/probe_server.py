"""A process that calls torch as a test asks, with or without the auditor's probes and stand-ins
installed, and answers what each call returned or raised (tests/capture/test_probes_accept_torch.py).

    python probe_server.py plain|probes|rehearsal|numerics

Each request is one line of JSON: [op, args, kwargs], the values as specs that this process builds
(so tensors are made where the call runs). Each answer is one line of JSON: the call's normalised
result, or ["E", exception type, whether the auditor's code raised it]. The first answer lists the
callables the auditor wrapped here (owner.name).
"""
from __future__ import annotations

import importlib
import io
import json
import math
import re
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


def _ours(value) -> bool:
    """Whether `value` is the auditor's: a function whose code lives in it, or a class defined there."""
    value = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
    if isinstance(value, type):
        return (value.__module__ or "").split(".")[0] == "auditor"
    code = getattr(value, "__code__", None) if isinstance(value, types.FunctionType) else None
    return isinstance(code, types.CodeType) and os.path.realpath(code.co_filename).startswith(AUDITOR_DIR)


def _members(owner) -> list:
    try:
        return list(vars(owner).items())
    except TypeError:
        return []


def wrapped() -> list[str]:
    """Every callable the auditor put in torch here (a probe, a stand-in, a class in torch's place):
    on the owners above by those names, then on every loaded torch module and the classes it
    defines, by module.Class.name (each object once)."""
    out, seen = [], set()
    owners = [(n, o) for n, o in OWNERS.items() if o is not None]
    for mod_name, mod in sorted(sys.modules.items()):
        if mod is None or not (mod_name == "torch" or mod_name.startswith("torch.")):
            continue
        owners.append((mod_name, mod))
        for name, value in _members(mod):
            if isinstance(value, type) and value.__module__ == mod_name:
                owners.append((f"{mod_name}.{name}", value))
    for owner_name, owner in owners:
        for name, value in _members(owner):
            try:
                if not _ours(value):
                    continue
            except Exception:  # noqa: BLE001 (a lazy attribute that fails on this machine is not ours)
                continue
            key = id(value.__func__ if isinstance(value, (staticmethod, classmethod)) else value)
            if key not in seen:
                seen.add(key)
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
    if kind == "fn":  # a hook, a closure, a lambda for a scheduler
        return lambda *a, **k: None
    if kind == "opt":  # an optimizer over a small model's parameters
        return torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
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
    if isinstance(x, str):  # (an object's repr names its address, which differs between processes)
        return re.sub(r" at 0x[0-9a-f]+", " at 0x", x)
    if x is None or isinstance(x, (bool, int, float)):
        return x
    kind = type(x)
    while (kind.__module__ or "").split(".")[0] == "auditor":  # (a class the audit puts in torch's place)
        kind = kind.__base__
    return ["other", kind.__name__]


def _lookup(path: str):
    """The object named by a dotted path as this process has it: a module, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise LookupError(path)


def _sgd():
    return torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)


def _loader():
    return torch.utils.data.DataLoader(torch.arange(4.0), batch_size=2)


# A method of one of these classes is called on a fresh instance (its constructor, on the class
# itself, or the concrete class named here)
RECEIVERS = {
    "torch.nn.modules.module.Module": lambda: torch.nn.Linear(2, 1),
    "torch.optim.optimizer.Optimizer": _sgd,
    "torch.optim.lr_scheduler.LRScheduler": lambda: torch.optim.lr_scheduler.StepLR(_sgd(), 1),
    "torch.optim.lr_scheduler.ReduceLROnPlateau": lambda: torch.optim.lr_scheduler.ReduceLROnPlateau(_sgd()),
    "torch.optim.lr_scheduler.ChainedScheduler": lambda: torch.optim.lr_scheduler.ChainedScheduler(
        [torch.optim.lr_scheduler.StepLR(_sgd(), 1)]),
    "torch.optim.lr_scheduler.SequentialLR": lambda: (lambda o: torch.optim.lr_scheduler.SequentialLR(
        o, [torch.optim.lr_scheduler.StepLR(o, 1), torch.optim.lr_scheduler.StepLR(o, 1)], milestones=[1]))(_sgd()),
    "torch.amp.grad_scaler.GradScaler": lambda: torch.amp.GradScaler("cpu"),
    "torch.amp.autocast_mode.autocast": lambda: torch.autocast("cpu"),
    "torch.utils.data.dataloader.DataLoader": _loader,
    "torch.utils.data.dataloader._BaseDataLoaderIter": lambda: iter(_loader()),
}
CONSTRUCTORS = {"torch.optim.optimizer.Optimizer": lambda: torch.optim.SGD,
                "torch.optim.lr_scheduler.LRScheduler": lambda: torch.optim.lr_scheduler.StepLR}


class NoReceiver(LookupError):
    """The server has no instance to call this method on (the test lists what it leaves out)."""


def resolve(op: str):
    """The callable named `op` as this process has it (wrapped or plain)."""
    if op in SPECIAL:
        return SPECIAL[op]
    owner_name, _, name = op.rpartition(".")
    owner = OWNERS[owner_name] if owner_name in OWNERS else _lookup(owner_name)
    if isinstance(owner, type) and owner is not torch.Tensor and not issubclass(owner, torch.Tensor):
        if name in ("__init__", "__new__"):
            return CONSTRUCTORS.get(owner_name, lambda: owner)()
        if owner_name not in RECEIVERS:
            raise NoReceiver(op)
        make = RECEIVERS[owner_name]
        return lambda *a, **k: getattr(make(), name)(*a, **k)
    if isinstance(owner, type) and name in ("__new__",):  # a tensor class: built by calling it
        return owner
    attr = getattr(owner, name)
    if isinstance(owner, type):
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
    # the public calls that reach the autograd Function internals the audit wraps
    "torch.utils.checkpoint.checkpoint": lambda *a, **k: torch.utils.checkpoint.checkpoint(
        lambda *xs: [x * 2 for x in xs if isinstance(x, torch.Tensor)], *a, use_reentrant=True, **k),
    "Tensor.backward": lambda t, *a, **k: t.sum().backward(*a, **k),
    # torch.save to a buffer and torch.load of it (the generated value is what is saved)
    "torch.save+load": lambda *a, **k: torch.load(_saved(*a, **k), weights_only=True),
}


def _saved(*a, **k) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(*a[:1], buffer, *a[1:], **k)
    buffer.seek(0)
    return buffer


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
