"""CUDA rehearsal, the memory side: the requests the program's GPU tensors would make of the caching
allocator, and `torch.cuda.memory`'s history calls answered from them.

While the program records a history (`torch.cuda.memory._record_memory_history()`), every tensor
the rehearsal marks as the GPU's (auditor.capture.rehearsal.device) is an allocation of its storage's
bytes on the default stream, with the user's Python stack, and is freed when the last marked tensor
on that storage is collected (those alive when recording begins are allocations made before the
trace, live blocks of the snapshot's segments); a marked leaf that requires grad has its gradient
taken the same way when autograd accumulates it (a post-accumulate-grad hook). `_snapshot()` / `_dump_snapshot()` then return what a GPU's allocator
would have recorded for those requests (auditor.evidence.allocator.synth runs them through the
simulated allocator, under PYTORCH_CUDA_ALLOC_CONF, on a device of `--device-memory` GiB or the
rehearsed device's memory), with each optimizer step's end as the profiler annotates it (so the
replay's reserve is told per step), so the program's own snapshot code runs, and `audit analyze` of the dump
forecasts the reserve and any OOM. Tensors only C++ sees (autograd's temporaries in the backward
pass, the gradients of non-leaf tensors) are not requests: the forecast is a lower bound.
"""
from __future__ import annotations

import functools
import gc
import os
import pickle
import sys
import time
import weakref
from typing import Any

import torch

import auditor
from auditor.capture import probes
from auditor.capture.frames import user_frame
from auditor.capture.numerics.deferral import hold_no_tensors
from auditor.capture.rehearsal import device
from auditor.evidence import model as m
from auditor.evidence.allocator.config import ConfError, parse_alloc_conf
from auditor.evidence.allocator.synth import snapshot_from_requests
from auditor.evidence.oom_record import REHEARSAL_FORECAST

_AUDITOR_DIR = os.path.dirname(auditor.__file__) + os.sep
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_STDLIB_DIR = os.path.dirname(os.__file__) + os.sep  # (weakref's finalizers run the frees)
MAX_FRAMES = 16
# The method as torch defines it, before the probes wrap it: this registration is the auditor's,
# never one of the program's hooks (hook-leak counts those).
_REGISTER_GRAD_HOOK = torch.Tensor.register_post_accumulate_grad_hook
GiB = 1 << 30


class Recorder:
    """The requests recorded since `_record_memory_history()` switched recording on."""

    def __init__(self, max_entries: int = 1_000_000) -> None:
        self.requests: list[dict[str, Any]] = []
        self.live: dict[int, list[int]] = {}  # storage address -> [marked tensors on it, allocation id]
        self.next_id = 0
        self.max_entries = max_entries
        self.seen: set[int] = set()  # ids of live leaves whose gradients are taken, and of those gradients
        self.annotations: list[dict[str, Any]] = []  # optimizer steps' ends, as torch's profiler annotates them
        self.sizes: dict[int, int] = {}  # allocation id -> requested bytes, while live
        self.stacks: dict[int, list[dict[str, Any]]] = {}  # once stopped: allocation id -> its stack, while live
        self.live_bytes = 0  # requested bytes live now
        self.peak_bytes = 0  # the most live since the last step boundary (take_peak)
        from torch.optim.optimizer import register_optimizer_step_post_hook
        self.hook = register_optimizer_step_post_hook(self._stepped)

    def _stepped(self, opt: Any, args: Any, kwargs: Any) -> None:
        name = type(opt).__name__
        self.annotations.append({"stage": "END", "name": f"Optimizer.step#{name}.step", "device": 0,
                                 "time_us": time.time_ns() // 1000})

    def seed(self, previous: Recorder | None = None) -> None:
        """The GPU tensors alive when recording begins (a model built and moved before the program
        switched its history on): allocations made before the trace, as a GPU's snapshot holds them
        in its segments with no trace entry, each with the stack `previous` (an earlier history)
        recorded for it. Found among the objects the garbage collector tracks (every tensor is
        one), once per recording."""
        for t in _marked_tensors():
            self.track(t, before=previous.frames_of(t) if previous is not None else True)

    def stop(self) -> None:
        """Recording switched off: nothing more is kept but the stacks of the allocations still
        alive (their frees are still counted, by the finalizers)."""
        self.hook.remove()
        self.max_entries = 0
        stacks = {r["id"]: r["frames"] for r in self.requests if r["action"] == "alloc" and r.get("frames")}
        self.stacks = {entry[1]: stacks[entry[1]] for entry in self.live.values() if entry[1] in stacks}
        self.requests = []

    def frames_of(self, t: torch.Tensor) -> list[dict[str, Any]] | bool:
        """The stack this (stopped) history recorded for `t`'s allocation, if it is still that one."""
        try:
            entry = self.live.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            return True
        return self.stacks.get(entry[1], True) if entry is not None else True

    def track(self, t: torch.Tensor, before: bool | list[dict[str, Any]] = False) -> None:
        try:
            st = t.untyped_storage()
            key, nbytes = st.data_ptr(), st.nbytes()
        except (RuntimeError, NotImplementedError):  # sparse, meta or functional tensors have no plain storage
            return
        if nbytes == 0:
            return
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [0, self.next_id]
            self.next_id += 1
            self._add("alloc", entry[1], nbytes, before)
        entry[0] += 1
        weakref.finalize(t, self._release, key, entry[1])
        if t.is_leaf and t.requires_grad and id(t) not in self.seen:
            # autograd makes the gradient in C++, out of the rehearsal's sight: taken when it lands
            self._see(t)
            _REGISTER_GRAD_HOOK(t, self._grad)

    def _see(self, t: torch.Tensor) -> None:
        """Remember `t` by id while it lives (a tensor's == is elementwise: no sets of tensors)."""
        self.seen.add(id(t))
        weakref.finalize(t, self.seen.discard, id(t))

    def _grad(self, p: torch.Tensor) -> None:
        g = p.grad
        if g is not None and id(g) not in self.seen:
            self._see(g)
            self.track(g)

    def _release(self, key: int, ident: int) -> None:
        entry = self.live.get(key)
        if entry is None or entry[1] != ident:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self.live[key]
            self._add("free", ident, 0)

    def take_peak(self) -> int:
        """The most requested bytes live since the last call; the count starts again from now."""
        peak, self.peak_bytes = self.peak_bytes, self.live_bytes
        return peak

    def _add(self, action: str, ident: int, size: int, before: bool = False) -> None:
        if action == "alloc":
            self.sizes[ident] = size
            self.live_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        else:
            self.live_bytes -= self.sizes.pop(ident, 0)
        if before:  # made before the history: a live block, with the stack of an earlier history or none
            self.requests.append({"action": action, "id": ident, "size": size, "stream": 0, "before": True,
                                  **({"frames": before} if isinstance(before, list) else {})})
        elif len(self.requests) < self.max_entries:
            self.requests.append({"action": action, "id": ident, "size": size, "stream": 0,
                                  "time_us": time.time_ns() // 1000, "frames": _stack()})


def _stack() -> list[dict[str, Any]]:
    """The Python stack outside the auditor, torch and the standard library, innermost first, as a
    snapshot records it."""
    out: list[dict[str, Any]] = []
    f: Any = sys._getframe(2)
    while f is not None and len(out) < MAX_FRAMES:
        fn = f.f_code.co_filename
        if not fn.startswith((_AUDITOR_DIR, _TORCH_DIR, _STDLIB_DIR)):
            out.append({"name": f.f_code.co_name, "filename": fn, "line": f.f_lineno})
        f = f.f_back
    return out


# recorder: the requests recorded; watch: the audit's own recording (--device-memory), from the run's
# start; program_from: where in the requests the program's own history begins, when it switched one
# on while the audit was recording (its snapshot holds the requests alive then as allocations made
# before the trace, as a GPU's does, and the trace from there on), OFF while the program has switched
# it off again (a snapshot then has no trace); program_spans: the requests each of the program's
# histories covered, (start, end), the last open (end None): a block allocated inside one keeps its
# stack in a later snapshot, as torch keeps a block's context after its history is cleared
# previous: the last history the program switched off (its blocks' stacks), when the audit does not record
_STATE: dict[str, Any] = {"recorder": None, "watch": None, "program_from": None, "program_spans": [],
                          "previous": None}
_AUDIT_CALL = [False]  # set while the audit itself switches recording on (watch), not the program
OFF = -1


def record_memory_history(enabled: Any = "all", *args: Any, max_entries: int = 1_000_000,
                          clear_history: bool = False, **kwargs: Any) -> None:
    """torch.cuda.memory._record_memory_history: on with any `enabled` but None; off, or on with
    `clear_history`, drops the history recorded so far, as torch's allocator clears its trace."""
    watching = _STATE["watch"] is not None
    spans = _STATE["program_spans"]
    if enabled is None or enabled is False:
        if watching:  # (the audit's own recording goes on: the forecast covers the whole run)
            if _STATE["program_from"] is not None:
                _STATE["program_from"] = OFF
                if spans and spans[-1][1] is None:
                    spans[-1] = (spans[-1][0], len(_STATE["recorder"].requests))
            return
        rec = _STATE["recorder"]
        if rec is not None:
            rec.stop()
            _STATE["previous"] = rec
        _STATE["recorder"] = None
        device.ON_MARK = None
        hold_no_tensors(False)
        return
    rec = _STATE["recorder"]
    if rec is not None and not watching and clear_history:
        record_memory_history(None)  # (a history begun again: what is alive now was made before it)
        rec = None
    if rec is None:
        hold_no_tensors(True)  # (the numerics checks keep no tensor alive past the program's use)
        rec = _STATE["recorder"] = Recorder(max_entries)
        rec.seed(_STATE["previous"])
    elif watching and not _AUDIT_CALL[0] and (_STATE["program_from"] in (None, OFF) or clear_history):
        now = len(rec.requests)
        if spans and spans[-1][1] is None:
            spans[-1] = (spans[-1][0], now)
        _STATE["program_from"] = now
        spans.append((now, None))
    device.ON_MARK = rec.track


FORECAST_FILE = REHEARSAL_FORECAST


def watch(out_dir: str, device_gib: float | None) -> bool:
    """Record the rehearsed device's requests from now on, as a GPU run records the allocator's
    history, when the device's memory is given (`--device-memory`): each step's end then states the
    requested bytes live (the device's allocated memory, a lower bound: autograd's temporaries are
    not requests), and the first step whose requests outgrow the device writes the snapshot a GPU
    would have written (FORECAST_FILE in `out_dir`), with the `oom` entry where the simulated
    allocator ran out. Without `--device-memory` (`device_gib`) nothing is recorded (it costs a
    weakref per tensor)."""
    if not device_gib:
        return False
    _AUDIT_CALL[0] = True
    try:
        record_memory_history(True)
    finally:
        _AUDIT_CALL[0] = False
    _STATE["watch"] = {"out": out_dir, "written": False, "capacity": int(device_gib * GiB)}
    return True



NEAR = 0.75  # a step whose requests reach this share of the device may be the one the allocator fails in


def step_end() -> tuple[int | None, str | None, bool]:
    """(requested bytes live now, the forecast snapshot's file name when this step's peak outgrew
    the device for the first time, whether the step came near the device's memory before that:
    the allocator, rounding requests up to its blocks, may run out a step before the requests
    alone outgrow it, and what held the memory then is scanned); (None, None, False) when the
    audit is not recording."""
    rec, w = _STATE["recorder"], _STATE["watch"]
    if rec is None or w is None:
        return None, None, False
    peak = rec.take_peak()
    if w["written"] or peak <= capacity():
        return rec.live_bytes, None, not w["written"] and peak >= NEAR * capacity()
    w["written"] = True
    # the forecast is made: the live bytes are still counted, no more entries are kept
    rec.max_entries = len(rec.requests)
    try:
        _dump(os.path.join(w["out"], FORECAST_FILE), program=False)
    except (OSError, pickle.PickleError):
        return rec.live_bytes, None, False
    return rec.live_bytes, FORECAST_FILE, False


def capacity() -> int:
    """The watched device's memory (`audit run --device-memory`), else the rehearsed device's."""
    w = _STATE["watch"]
    return w["capacity"] if w is not None else torch.cuda.get_device_properties(0).total_memory


def _requests(program: bool) -> list[dict[str, Any]]:
    """The recorded requests; for the program's own snapshot, from where its history began (those
    alive then as allocations made before the trace)."""
    rec = _STATE["recorder"]
    if rec is None:
        return _alive_now()
    start = _STATE["program_from"] if program else None
    if start is None:
        return rec.requests
    if start == OFF:
        start = len(rec.requests)
    spans = [(a, b) for a, b in _STATE["program_spans"] if b is not None and b <= start]
    live: dict[int, dict[str, Any]] = {}
    for i, r in enumerate(rec.requests[:start]):
        if r["action"] == "alloc":
            frames = r.get("frames") if any(a <= i < b for a, b in spans) else None
            live[r["id"]] = {"action": "alloc", "id": r["id"], "size": r["size"], "stream": 0, "before": True,
                             **({"frames": frames} if frames else {})}
        else:
            live.pop(r["id"], None)
    return list(live.values()) + rec.requests[start:]


def _alive_now() -> list[dict[str, Any]]:
    """The GPU tensors alive now as allocations made before any history: what a snapshot taken
    with nothing recording holds (its segments, no trace). Read from the garbage collector's
    objects, one request per storage, without tracking them."""
    previous = _STATE["previous"]
    out: dict[int, dict[str, Any]] = {}
    for t in _marked_tensors():
        try:
            st = t.untyped_storage()
            key, nbytes = st.data_ptr(), st.nbytes()
        except (RuntimeError, NotImplementedError):
            continue
        if nbytes and key not in out:
            frames = previous.frames_of(t) if previous is not None else True
            out[key] = {"action": "alloc", "id": len(out), "size": nbytes, "stream": 0, "before": True,
                        **({"frames": frames} if isinstance(frames, list) else {})}
    return list(out.values())


def _marked_tensors() -> list[torch.Tensor]:
    """The tensors the rehearsal marks as the GPU's, among the objects the garbage collector tracks
    (every tensor is one)."""
    return [obj for obj in gc.get_objects()
            if issubclass(type(obj), torch.Tensor) and getattr(obj, device.CUDA_MARK, False) is True]


def _snapshot(program: bool) -> dict[str, Any]:
    rec = _STATE["recorder"]
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    try:
        cfg = parse_alloc_conf(conf)
    except ConfError:
        cfg = parse_alloc_conf("")
    out = snapshot_from_requests(_requests(program), cfg, capacity(), conf)
    out["external_annotations"] = list(rec.annotations) if rec else []
    return out


def _dump(filename: str, program: bool) -> None:
    with open(filename, "wb") as f:
        pickle.dump(_snapshot(program), f, protocol=4)


def snapshot(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """torch.cuda.memory._snapshot, as the program's history has it."""
    return _snapshot(program=True)


def dump_snapshot(filename: str = "dump_snapshot.pickle", *args: Any, **kwargs: Any) -> None:
    """torch.cuda.memory._dump_snapshot, as the program's history has it."""
    _dump(filename, program=True)


def install() -> list[str]:
    """Answer torch.cuda.memory's history calls from the rehearsed requests; each call is recorded
    at the user's line as the other stand-ins are (a `cuda-standin` tally)."""
    mem = torch.cuda.memory
    replaced = []
    for name, impl in (("_record_memory_history", record_memory_history), ("_snapshot", snapshot),
                       ("_dump_snapshot", dump_snapshot)):
        if not hasattr(mem, name):
            continue

        def standin(*args: Any, __name: str = f"torch.cuda.memory.{name}", __impl: Any = impl, **kwargs: Any) -> Any:
            rec = probes.REC
            if rec is not None and rec.active:
                rec.add(m.CUDA_STANDIN, __name, user_frame(sys._getframe(1)))
            return __impl(*args, **kwargs)

        functools.update_wrapper(standin, getattr(mem, name))
        setattr(mem, name, standin)
        replaced.append(f"memory.{name}")
    return replaced
