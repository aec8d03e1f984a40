"""Probes on data-parallel training: torch.distributed collectives, DistributedDataParallel and
nn.DataParallel. A Collector (auditor.capture.collectors): its per-step data becomes
`StepRecord.distributed` (auditor.evidence.distributed.DistStep), the configuration seen at the end
`Evidence.distributed` (DistInfo); the dicts it returns have those types' fields.

What it measures, and why this way:
- Explicit collectives the user calls (`dist.all_reduce(loss)`, `dist.barrier()`): count, payload
  bytes, the user's line and each call's wall time, kept call by call: across ranks the fastest
  one's time for a call is its transfer, the rest is waiting.
- DDP's gradient all-reduce happens in C++ during backward, out of Python's sight. A
  post-accumulate-grad hook on each parameter notes when the last local gradient is ready; an
  autograd-engine callback, queued behind DDP's own `finalize_backward`, notes when backward has
  really finished. The gap is how long this rank sat in the gradient sync (transfer + waiting).
- DDP's per-forward buffer broadcast and its unused-parameter search (`_sync_buffers`,
  `_post_forward`) are timed when those private methods exist; which parameters received a
  gradient and whether any buffer changed (its version counter; DDP's own broadcast preserves it)
  are what `ddp-config` needs to say a setting buys nothing.

Nothing here changes arguments, results, or the order of any collective: hooks only read clocks.
"""
from __future__ import annotations

import inspect
import os
import sys
import time
import weakref
from typing import Any, Callable

import torch

from auditor.capture import this_process
from auditor.capture.frames import is_torch_internal, user_frame

perf = time.perf_counter
MAX_CALL_TIMES = 32  # per site per step: enough to match calls across ranks, bounded for huge loops

# The collectives a training step calls directly, and which argument carries the payload
# (None: no tensor payload, e.g. barrier or the pickled *_object variants).
COLLECTIVES: dict[str, int | None] = {
    "all_reduce": 0, "broadcast": 0, "reduce": 0, "all_gather": 1, "all_gather_into_tensor": 1,
    "reduce_scatter": 1, "reduce_scatter_tensor": 1, "all_to_all": 1, "all_to_all_single": 1,
    "gather": 0, "scatter": 0, "barrier": None, "monitored_barrier": None, "all_gather_object": None,
    "broadcast_object_list": None, "gather_object": None, "scatter_object_list": None,
    "all_reduce_coalesced": 0,
}
DDP_KWARGS = ("find_unused_parameters", "bucket_cap_mb", "broadcast_buffers", "forward_sync_buffers",
              "gradient_as_bucket_view", "static_graph", "device_ids", "output_device")


def _payload_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_payload_bytes(v) for v in value)
    return 0


def _frame_dict(where: tuple[str, int, str] | None) -> dict[str, Any] | None:
    return {"file": where[0], "line": where[1], "function": where[2]} if where else None


def _wrap(owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace owner.name by make(original), once (a re-install is a no-op)."""
    orig = getattr(owner, name, None)
    if orig is None or getattr(orig, "__audit_original__", None) is not None:
        return
    new = make(orig)
    try:
        new.__wrapped__ = orig
        new.__name__ = getattr(orig, "__name__", name)
        new.__doc__ = getattr(orig, "__doc__", None)
    except (AttributeError, TypeError):
        pass
    new.__audit_original__ = orig
    setattr(owner, name, new)


class _Site:
    """One explicit collective at one user line, within one step."""

    __slots__ = ("op", "where", "ms", "bytes", "calls", "async_calls")

    def __init__(self, op: str, where: tuple[str, int, str] | None) -> None:
        self.op, self.where = op, where
        self.ms: list[float] = []
        self.bytes = 0
        self.calls = 0
        self.async_calls = 0

    def as_dict(self) -> dict[str, Any]:
        return {"op": self.op, "where": _frame_dict(self.where), "calls": self.calls, "ms": self.ms,
                "total_ms": sum(self.ms), "bytes": self.bytes, "async_calls": self.async_calls}


class DistProbes:
    """The collector. One instance per audited process; inert in forked DataLoader workers."""

    name = "distributed"

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.ddps: list[weakref.ref] = []
        self.ddp_info: list[dict[str, Any]] = []
        self.dps: list[dict[str, Any]] = []
        self.dp_refs: list[weakref.ref] = []
        self.forward_synced: dict[int, bool] = {}  # DDP's sync decision is taken at forward time
        self.used = False  # anything distributed seen at all: otherwise no evidence is added
        self._reset_step()

    # -- collector protocol ---------------------------------------------------------------------
    def install(self) -> None:
        import torch.distributed as dist

        if not dist.is_available():
            return
        import torch.distributed.distributed_c10d as c10d

        for op, arg in COLLECTIVES.items():
            for owner in (dist, c10d):
                if hasattr(owner, op):
                    _wrap(owner, op, self._collective(op, arg))
        from torch.nn.parallel import DistributedDataParallel as DDP

        _wrap(DDP, "__init__", self._ddp_init)
        _wrap(DDP, "forward", self._ddp_forward)
        _wrap(DDP, "no_sync", self._ddp_no_sync)
        _wrap(DDP, "_sync_buffers", self._buffer_sync)
        _wrap(DDP, "_post_forward", self._timed("post_forward_ms"))
        _wrap(torch.nn.DataParallel, "__init__", self._dp_init)
        _wrap(torch.nn.DataParallel, "forward", self._dp_forward)

    def step_begin(self, index: int) -> None:
        self._reset_step()
        for i, ref in enumerate(self.ddps):
            ddp = ref()
            if ddp is not None:
                self.buffer_versions[i] = self._versions(ddp)

    def step_end(self, index: int) -> dict[str, Any] | None:
        if not self.used:
            return None
        changed = {}
        for i, ref in enumerate(self.ddps):
            ddp = ref()
            if ddp is not None and i in self.buffer_versions:
                now, start = self._versions(ddp), self.buffer_versions[i]
                bumps = self.sync_bumps.get(i, [0] * len(now))
                changed[str(i)] = (len(now) != len(start) or len(bumps) != len(now)
                                   or any(n - s - b for n, s, b in zip(now, start, bumps)))
        return {
            "collectives": [s.as_dict() for s in self.sites.values()],
            "backward_syncs": self.backward_syncs,
            "ddp_forwards": [{"ddp": int(k), **v} for k, v in self.forwards.items()],
            "dp_forwards": [{"dp": int(k), **v} for k, v in self.dp_forwards.items()],
            "no_sync_entries": self.no_sync_entries,
            "buffers_changed": changed,
            "params_with_grad": {str(k): len(v) for k, v in self.grads.items()},
        }

    def finish(self) -> dict[str, Any] | None:
        if not self.used:
            return None
        for i, ref in enumerate(self.ddps):
            ddp = ref()
            if ddp is not None:
                self.ddp_info[i].update(self._ddp_runtime(ddp))
        return {**self._identity(), "ddp": self.ddp_info, "data_parallel": self.dps}

    # -- state ----------------------------------------------------------------------------------
    def _on(self) -> bool:
        return this_process.PID == self.pid

    def _reset_step(self) -> None:
        self.sites: dict[tuple, _Site] = {}
        self.backward_syncs: list[dict[str, Any]] = []
        self.forwards: dict[int, dict[str, Any]] = {}
        self.dp_forwards: dict[int, dict[str, Any]] = {}
        self.no_sync_entries = 0
        self.buffer_versions: dict[int, list[int]] = {}  # per DDP: buffer version counters at step start
        # per DDP: what DDP's own buffer broadcasts added to those counters this step (2.11 among
        # other versions copies the broadcast's result into each buffer, even on one rank: no change)
        self.sync_bumps: dict[int, list[int]] = {}
        self.grads: dict[int, set[int]] = {}
        self.pending: dict[str, Any] | None = None  # the backward in flight

    @staticmethod
    def _identity() -> dict[str, Any]:
        import torch.distributed as dist

        out: dict[str, Any] = {"initialized": bool(dist.is_available() and dist.is_initialized())}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
            if key in os.environ:
                out[key.lower()] = int(os.environ[key]) if os.environ[key].isdigit() else os.environ[key]
        if out["initialized"]:
            out["rank"], out["world_size"] = dist.get_rank(), dist.get_world_size()
            out["backend"] = str(dist.get_backend())
        return out

    @staticmethod
    def _versions(ddp: Any) -> list[int]:
        try:
            return [b._version for b in ddp.module.buffers()]
        except Exception:
            return []

    # -- explicit collectives -------------------------------------------------------------------
    def _collective(self, op: str, payload_arg: int | None) -> Callable[[Callable], Callable]:
        def make(orig: Callable) -> Callable:
            def probe(*args: Any, **kwargs: Any) -> Any:
                if not self._on():
                    return orig(*args, **kwargs)
                f = sys._getframe(1)
                if is_torch_internal(f.f_code.co_filename):  # torch calling itself (DDP, *_object)
                    return orig(*args, **kwargs)
                t0 = perf()
                try:
                    return orig(*args, **kwargs)
                finally:
                    ms = (perf() - t0) * 1e3
                    where = user_frame(f)
                    site = self.sites.get((op, where))
                    if site is None:
                        site = self.sites[(op, where)] = _Site(op, where)
                    site.calls += 1
                    if len(site.ms) < MAX_CALL_TIMES:
                        site.ms.append(round(ms, 4))
                    if payload_arg is not None and len(args) > payload_arg:
                        site.bytes += _payload_bytes(args[payload_arg])
                    if kwargs.get("async_op"):
                        site.async_calls += 1
                    self.used = True
            return probe
        return make

    # -- DistributedDataParallel ----------------------------------------------------------------
    def _ddp_init(self, orig: Callable) -> Callable:
        sig = inspect.signature(orig)

        def probe(ddp: Any, *args: Any, **kwargs: Any) -> None:
            orig(ddp, *args, **kwargs)
            if not self._on():
                return
            try:
                given = sig.bind(ddp, *args, **kwargs).arguments
            except TypeError:
                given = dict(kwargs)
            index = len(self.ddps)
            self.ddps.append(weakref.ref(ddp))
            self.ddp_info.append(self._ddp_config(ddp, given, index, user_frame(sys._getframe(1)), sig))
            self._hook_params(ddp, index)
            self.used = True
        return probe

    @staticmethod
    def _ddp_config(ddp: Any, given: dict[str, Any], index: int, where: tuple[str, int, str] | None,
                    sig: inspect.Signature) -> dict[str, Any]:
        params = [p for p in ddp.module.parameters() if p.requires_grad]
        grad_bytes = [p.numel() * p.element_size() for p in params]
        buffers = list(ddp.module.buffers())
        broadcast = getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", True))
        return {
            "index": index, "where": _frame_dict(where),
            "given": {k: repr(v) for k, v in given.items() if k in DDP_KWARGS},
            "find_unused_parameters": bool(getattr(ddp, "find_unused_parameters", False)),
            "gradient_as_bucket_view": bool(getattr(ddp, "gradient_as_bucket_view", False)),
            "static_graph": bool(given.get("static_graph", False)),
            "broadcast_buffers": bool(broadcast),
            # newer torch deprecates broadcast_buffers for forward_sync_buffers: the fix names the one this torch has
            "broadcast_kwarg": ("forward_sync_buffers" if "forward_sync_buffers" in sig.parameters
                                else "broadcast_buffers"),
            "bucket_cap_bytes": int(getattr(ddp, "bucket_bytes_cap", 25 * 2**20)),
            "bucket_cap_mb_given": given.get("bucket_cap_mb"),
            "params": len(params), "grad_bytes": sum(grad_bytes), "largest_grad_bytes": max(grad_bytes, default=0),
            "buffers": len(buffers), "buffer_bytes": sum(b.numel() * b.element_size() for b in buffers),
            "device": str(getattr(ddp, "device", "")),
        }

    @staticmethod
    def _ddp_runtime(ddp: Any) -> dict[str, Any]:
        """What DDP itself reports after running: the real bucket layout and unused-parameter size."""
        try:
            data = ddp._get_ddp_logging_data()
        except Exception:
            return {}
        sizes = [int(s) for s in str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or "")
                 .replace(",", " ").split() if s.isdigit()]
        return {"bucket_sizes": sizes, "unused_parameter_size": data.get("unused_parameter_size"),
                "comm_hook": data.get("comm_hook") or None, "static_graph_runtime": bool(data.get("static_graph"))}

    def _hook_params(self, ddp: Any, index: int) -> None:
        from torch.autograd import Variable

        def queue_end() -> None:  # runs as the first final callback; re-queue behind DDP's finalize
            Variable._execution_engine.queue_callback(backward_end)

        def backward_end() -> None:
            p = self.pending
            self.pending = None
            if p is None:
                return
            p["sync_ms"] = round((perf() - p.pop("ready")) * 1e3, 4)
            self.backward_syncs.append(p)

        def on_grad(j: int) -> None:
            self.grads.setdefault(index, set()).add(j)
            now = perf()
            if self.pending is not None:
                self.pending["ready"] = now
                return
            self.pending = {"ddp": index, "synced": self.forward_synced.get(index, True), "ready": now}
            try:
                Variable._execution_engine.queue_callback(queue_end)
            except RuntimeError:  # not inside an engine run
                self.pending = None

        for j, param in enumerate(q for q in ddp.module.parameters() if q.requires_grad):
            def hook(_: Any, j: int = j) -> None:
                if self._on():
                    try:
                        on_grad(j)
                    except Exception:  # a probe must never break the user's backward
                        self.pending = None
            try:
                param.register_post_accumulate_grad_hook(hook)
            except (AttributeError, RuntimeError):  # torch < 2.1: no gradient-ready timing
                return

    def _ddp_forward(self, orig: Callable) -> Callable:
        def probe(ddp: Any, *args: Any, **kwargs: Any) -> Any:
            if not self._on():
                return orig(ddp, *args, **kwargs)
            index = self._index(ddp)
            rec = self.forwards.setdefault(index, {"calls": 0, "synced": 0, "ms": 0.0, "buffer_sync_ms": 0.0,
                                                    "buffer_syncs": 0, "post_forward_ms": 0.0})
            rec["calls"] += 1
            synced = bool(getattr(ddp, "require_backward_grad_sync", True)) and torch.is_grad_enabled()
            rec["synced"] += synced
            self.forward_synced[index] = synced
            t0 = perf()
            try:
                return orig(ddp, *args, **kwargs)
            finally:
                rec["ms"] += (perf() - t0) * 1e3
        return probe

    def _timed(self, field: str) -> Callable[[Callable], Callable]:
        def make(orig: Callable) -> Callable:
            def probe(ddp: Any, *args: Any, **kwargs: Any) -> Any:
                t0 = perf()
                try:
                    return orig(ddp, *args, **kwargs)
                finally:
                    rec = self.forwards.get(self._index(ddp)) if self._on() else None
                    if rec is not None:
                        rec[field] += (perf() - t0) * 1e3
                        if field == "buffer_sync_ms":
                            rec["buffer_syncs"] += 1
            return probe
        return make

    def _buffer_sync(self, orig: Callable) -> Callable:
        """DDP's broadcast of the module's buffers: timed, and what it adds to their version
        counters kept apart from the program's own changes."""
        timed = self._timed("buffer_sync_ms")(orig)

        def probe(ddp: Any, *args: Any, **kwargs: Any) -> Any:
            if not self._on():
                return orig(ddp, *args, **kwargs)
            before = self._versions(ddp)
            try:
                return timed(ddp, *args, **kwargs)
            finally:
                after, i = self._versions(ddp), self._index(ddp)
                if i >= 0 and len(after) == len(before):
                    bumps = self.sync_bumps.setdefault(i, [0] * len(after))
                    if len(bumps) == len(after):
                        self.sync_bumps[i] = [b + a - v for b, a, v in zip(bumps, after, before)]
        return probe

    def _ddp_no_sync(self, orig: Callable) -> Callable:
        def probe(ddp: Any, *args: Any, **kwargs: Any) -> Any:
            if self._on():
                self.no_sync_entries += 1
            return orig(ddp, *args, **kwargs)
        return probe

    def _index(self, ddp: Any, refs: list[weakref.ref] | None = None) -> int:
        for i, ref in enumerate(self.ddps if refs is None else refs):
            if ref() is ddp:
                return i
        return -1

    # -- nn.DataParallel ------------------------------------------------------------------------
    def _dp_init(self, orig: Callable) -> Callable:
        def probe(dp: Any, *args: Any, **kwargs: Any) -> None:
            orig(dp, *args, **kwargs)
            if not self._on():
                return
            self.dp_refs.append(weakref.ref(dp))
            self.dps.append({"index": len(self.dps), "where": _frame_dict(user_frame(sys._getframe(1))),
                             "device_ids": [int(d) for d in (getattr(dp, "device_ids", None) or [])],
                             "module": type(getattr(dp, "module", None)).__name__,
                             "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0})
            self.used = True
        return probe

    def _dp_forward(self, orig: Callable) -> Callable:
        def probe(dp: Any, *args: Any, **kwargs: Any) -> Any:
            if not self._on():
                return orig(dp, *args, **kwargs)
            rec = self.dp_forwards.setdefault(self._index(dp, self.dp_refs), {"calls": 0, "ms": 0.0})
            rec["calls"] += 1
            t0 = perf()
            try:
                return orig(dp, *args, **kwargs)
            finally:
                rec["ms"] += (perf() - t0) * 1e3
        return probe
