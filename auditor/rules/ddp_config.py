"""ddp-config: DistributedDataParallel settings that cost time or memory and buy nothing here."""
from __future__ import annotations

import re
from statistics import median
from typing import Any, Iterable

from auditor.evidence import model as m
from auditor.evidence.frame import Frame
from auditor.evidence.distributed import DdpConfig as DdpSeen, DistStep, frame_of
from auditor.rules.base import Option, Options, Rule
from auditor.findings import Cost, Edit, Finding, Fix, Location, share_of_step, step_basis_ms
from auditor.fixes import edit_call_kwargs

_CALLEE = re.compile(r"([A-Za-z_][\w.]*)\s*\(")
MB = 2**20
Rows = list[tuple[m.StepRecord, DistStep]]  # each step with its distributed-probe data


class DdpConfig(Rule):
    """
    What it detects:
        DistributedDataParallel(...) settings the run shows to be wasted:
        `find_unused_parameters=True` while every parameter receives a gradient in every step;
        a bucket size far from the gradient sizes (everything in one bucket, so no communication
        overlaps the backward, or a great many tiny buckets); buffer broadcasting before every
        forward while no buffer ever changes; `gradient_as_bucket_view=False` on large models;
        gradient accumulation without `no_sync()`, so every micro-batch all-reduces.

    Why it costs:
        find_unused_parameters makes DDP walk the autograd graph after every forward. One bucket
        means the all-reduce starts only once the whole backward is done; tiny buckets pay the
        collective's latency many times. Broadcasting unchanged buffers is a collective per
        forward for nothing. Without gradient_as_bucket_view every gradient exists twice. Without
        no_sync, accumulation all-reduces N times what it needs.

    Example:
        bad:   DDP(model, find_unused_parameters=True)   # every parameter is used
        good:  DDP(model)

    Fix:
        Edit the DDP(...) call as the finding says (the patch does it); for accumulation, run all
        but the last micro-batch inside `with model.no_sync():`.

    Evidence needed:
        A run with the distributed probes: DDP's configuration and runtime bucket layout, which
        parameters received gradients, buffer version counters, and the timed gradient sync.
    """

    id = "ddp-config"
    title = "DistributedDataParallel is configured against what this model does"
    severity = "warning"
    category = "performance"
    needs = frozenset({"run"})
    needs_text = "needs a run that constructs DistributedDataParallel"
    options = (
        Option("min-steps", 2, "Judge a setting only after this many steps that used it."),
        Option("one-bucket-min-mb", 32.0, "Flag a single gradient bucket only for models with at least this "
                                          "many MiB of gradients."),
        Option("one-bucket-min-sync-share", 0.05, "... and when the gradient sync after backward takes at least "
                                                  "this share of the step."),
        Option("max-buckets", 64, "Flag more buckets than this when the bucket cap is below DDP's default."),
        Option("bucket-view-min-mb", 64.0, "Suggest gradient_as_bucket_view for at least this many MiB of "
                                           "gradients (the memory it saves)."),
    )

    def skip_reason(self, ev: m.Evidence) -> str | None:
        return None if ev.distributed is not None and ev.distributed.ddp else \
            self.needs_text

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        for ddp in ev.distributed.ddp if ev.distributed is not None else []:
            where = frame_of(ddp.where)
            rows = [(s, s.distributed or DistStep()) for s in ev.steps if not s.failed]
            for check in (self._find_unused, self._buckets, self._buffers, self._bucket_view, self._no_sync):
                f = check(ev, ddp, where, rows, options)
                if f is not None:
                    yield f

    # -- individual checks ----------------------------------------------------------------------
    def _find_unused(self, ev: m.Evidence, ddp: DdpSeen, where: Frame | None, rows: Rows,
                 options: Options) -> Finding | None:
        if not ddp.find_unused_parameters:
            return None
        idx = str(ddp.index)
        used = [d.params_with_grad.get(idx) for _, d in rows if _synced(d, ddp.index)]
        used = [u for u in used if u is not None]
        if len(used) < options["min-steps"] or any(u < ddp.params for u in used) \
                or (ddp.unused_parameter_size or 0) > 0:
            return None
        search = _median_step(rows, ddp.index, "post_forward_ms")
        return self._finding(
            ev, where,
            "DDP looks for unused parameters and finds none: set it False. "
            f"DistributedDataParallel(find_unused_parameters=True) while all {ddp.params} trainable parameters "
            f"received a gradient in each of the {len(used)} steps: DDP searches the autograd graph for unused "
            f"parameters after every forward ({search:.2f} ms per step here) and cannot overlap as well.",
            {"check": "find_unused_parameters", "params": ddp.params, "steps_all_used": len(used),
             "post_forward_ms": round(search, 4)},
            search, "Drop find_unused_parameters=True: every parameter is used.",
            {"DistributedDataParallel.find_unused_parameters": False}, drop=("find_unused_parameters",))

    def _buckets(self, ev: m.Evidence, ddp: DdpSeen, where: Frame | None, rows: Rows,
                 options: Options) -> Finding | None:
        sizes = ddp.bucket_sizes or []
        grad, cap = ddp.grad_bytes, ddp.bucket_cap_bytes
        if not sizes or not grad:
            return None
        sync = _median_sync(rows, ddp.index)
        step = step_basis_ms(ev) or 0.0
        if len(sizes) == 1 and grad >= options["one-bucket-min-mb"] * MB and step \
                and sync / step >= options["one-bucket-min-sync-share"]:
            suggest = max(1, round(grad / MB / 4))
            return self._finding(
                ev, where,
                "Gradients sync only after the backward: use smaller DDP buckets. "
                f"All {grad / MB:.0f} MiB of gradients fit in one DDP bucket (cap {cap / MB:.0f} MiB), so the "
                f"all-reduce starts only after the whole backward: {sync:.1f} ms per step after the last gradient "
                f"({share_of_step(round(sync, 4), step):.0%} of the run's time) instead of overlapping it.",
                {"check": "bucket_size", "buckets": len(sizes), "grad_bytes": grad, "bucket_cap_bytes": cap,
                 "sync_after_backward_ms": round(sync, 3), "suggested_bucket_cap_mb": suggest},
                sync, f"Set bucket_cap_mb={suggest} so about four buckets overlap the backward.",
                {"DistributedDataParallel.bucket_cap_mb": suggest}, set_kwargs={"bucket_cap_mb": str(suggest)})
        if len(sizes) > options["max-buckets"] and cap < 25 * MB:
            return self._finding(
                ev, where,
                "DDP buckets are too small: use the default 25 MiB or larger. "
                f"{len(sizes)} DDP buckets of {median(sizes) / MB:.2f} MiB (median) for {grad / MB:.0f} MiB of "
                f"gradients: bucket_cap_mb={cap / MB:g} pays the all-reduce's latency {len(sizes)} times per step.",
                {"check": "bucket_size", "buckets": len(sizes), "grad_bytes": grad, "bucket_cap_bytes": cap,
                 "median_bucket_bytes": median(sizes), "sync_after_backward_ms": round(sync, 3)},
                None, "Use DDP's default 25 MiB buckets (or larger).",
                {"DistributedDataParallel.bucket_cap_mb": 25}, set_kwargs={"bucket_cap_mb": "25"})
        return None

    def _buffers(self, ev: m.Evidence, ddp: DdpSeen, where: Frame | None, rows: Rows,
                 options: Options) -> Finding | None:
        if not ddp.broadcast_buffers or not ddp.buffers:
            return None
        idx = str(ddp.index)
        seen = [d.buffers_changed[idx] for _, d in rows if idx in d.buffers_changed]
        if len(seen) < options["min-steps"] or any(seen):
            return None
        cost = _median_step(rows, ddp.index, "buffer_sync_ms")
        kw = ddp.broadcast_kwarg
        drop = ("broadcast_buffers",) if kw != "broadcast_buffers" else ()
        return self._finding(
            ev, where,
            "DDP broadcasts buffers that never change: set broadcast_buffers=False. "
            f"DDP broadcasts the module's {ddp.buffers} buffer(s) ({ddp.buffer_bytes / 1024:.1f} KiB) "
            f"from rank 0 "
            f"before every forward, but no buffer changed in any of the {len(seen)} steps: a collective per forward "
            f"({cost:.2f} ms per step here) that copies nothing new.",
            {"check": "broadcast_buffers", "buffers": ddp.buffers, "buffer_bytes": ddp.buffer_bytes,
             "steps_unchanged": len(seen), "buffer_sync_ms": round(cost, 4)},
            cost, f"Set {kw}=False: the buffers never change, so the copies made at construction stay equal.",
            {f"DistributedDataParallel.{kw}": False}, set_kwargs={kw: "False"}, drop=drop)

    def _bucket_view(self, ev: m.Evidence, ddp: DdpSeen, where: Frame | None, rows: Rows,
                 options: Options) -> Finding | None:
        grad = ddp.grad_bytes
        if ddp.gradient_as_bucket_view or grad < options["bucket-view-min-mb"] * MB:
            return None
        return self._finding(
            ev, where,
            "Gradients are kept twice: set gradient_as_bucket_view=True. "
            f"DDP has gradient_as_bucket_view=False: each of the {grad / MB:.0f} MiB of gradients is kept twice, once in "
            f"the parameter's .grad and once in DDP's communication bucket.",
            {"check": "gradient_as_bucket_view", "grad_bytes": grad}, None,
            "Set gradient_as_bucket_view=True (gradients become views into the buckets; do not replace .grad "
            "tensors by hand afterwards).",
            {"DistributedDataParallel.gradient_as_bucket_view": True},
            set_kwargs={"gradient_as_bucket_view": "True"}, severity="info",
            note=f"memory: {grad / MB:.0f} MiB saved")

    def _no_sync(self, ev: m.Evidence, ddp: DdpSeen, where: Frame | None, rows: Rows,
                 options: Options) -> Finding | None:
        opt_steps = {s.index: sum(t.count for t in s.tallies if t.kind == m.OPTIMIZER) for s, _ in rows}
        extra_ms, hits, judged = [], 0, 0
        for s, d in rows:
            syncs = [b for b in d.backward_syncs if b.ddp == ddp.index and b.synced]
            n_opt = opt_steps.get(s.index, 0)
            if not n_opt or not syncs:
                continue
            judged += 1
            if len(syncs) >= 2 * n_opt and not d.no_sync_entries:
                hits += 1
                extra_ms.append(sum(b.sync_ms for b in syncs[:-n_opt]))
        if judged < options["min-steps"] or hits < 0.6 * judged:
            return None
        cost = median(extra_ms)
        per = median(len([b for b in d.backward_syncs if b.ddp == ddp.index]) for _, d in rows
                     if d.backward_syncs)
        backward = next((t.where for _, t in ev.tallies(m.BACKWARD) if t.where), None)
        f = self._finding(
            ev, where,
            "Every micro-batch syncs gradients: use no_sync() until the last. "
            f"Gradient accumulation without no_sync(): {per:g} backward passes per optimizer step each all-reduce "
            f"the gradients; only the last needs to ({cost:.1f} ms per step in the extra syncs).",
            {"check": "no_sync", "backwards_per_optimizer_step": per, "steps": hits, "extra_sync_ms": round(cost, 3)},
            cost, "Run all but the last micro-batch inside `with model.no_sync():` (forward and backward).",
            {"DistributedDataParallel.no_sync": "all but the last micro-batch"}, no_edit=True)
        if backward is not None:
            import msgspec

            f = msgspec.structs.replace(f, locations=[*f.locations, Location.of(backward)])
        return f

    # -- shared ---------------------------------------------------------------------------------
    def _finding(self, ev: m.Evidence, where: Frame | None, message: str, evidence: dict[str, Any],
                 ms: float | None, summary: str, config: dict[str, Any], set_kwargs: dict[str, str] | None = None,
                 drop: tuple[str, ...] = (), severity: str | None = None, note: str | None = None,
                 no_edit: bool = False) -> Finding:
        edit = None if no_edit or where is None else _edit(where, set_kwargs, drop)
        ms = round(ms, 4) if ms is not None else None
        return self.finding(
            message, severity=severity, locations=[Location.of(where)] if where else [], evidence=evidence,
            cost=Cost(ms_per_step=ms, share_of_step=share_of_step(ms, step_basis_ms(ev)),
                      measured=ms is not None, note=note),
            fix=Fix(summary=summary, config=config, edits=[edit] if edit else []))


def _edit(where: Frame, set_kwargs: dict[str, str] | None, drop: tuple[str, ...]) -> Edit | None:
    """The DDP(...) call on the user's line, under whatever name it was imported as."""
    names = {"DistributedDataParallel", "DDP", *(n.rsplit(".", 1)[-1] for n in _CALLEE.findall(where.code))}
    return edit_call_kwargs(where.file, where.line, names, set_kwargs=set_kwargs, drop=drop)


def _synced(d: DistStep, index: int) -> bool:
    return any(b.ddp == index and b.synced for b in d.backward_syncs)


def _median_step(rows: Rows, index: int, key: str) -> float:
    vals = [getattr(f, key) for _, d in rows for f in d.ddp_forwards if f.ddp == index]
    return median(vals) if vals else 0.0


def _median_sync(rows: Rows, index: int) -> float:
    vals = [sum(b.sync_ms for b in d.backward_syncs if b.ddp == index and b.synced)
            for _, d in rows if _synced(d, index)]
    return median(vals) if vals else 0.0
