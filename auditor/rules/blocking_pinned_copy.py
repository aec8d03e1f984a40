"""blocking-pinned-copy: host-to-device copies from pinned memory made without non_blocking=True.

Two halves. The trace half reads a profiler trace recorded on a GPU (`audit analyze TRACE`, and the
profiler window of `audit run` on a CUDA machine): a `Memcpy HtoD (Pinned -> Device)` whose launch
call's operator (the `aten::copy_` of a `.to()` / `.cuda()` / `copy_`) also synchronised the stream
after launching it. That is what torch records for `non_blocking=False`: its CUDA copy
(aten/src/ATen/native/cuda/Copy.cu) calls `cudaMemcpyAsync` alone for `non_blocking=True`, and
`memcpy_and_sync` (`cudaMemcpyAsync` then `cudaStreamSynchronize`) otherwise, whatever the host
memory. The rehearsal half judges a CUDA rehearsal on the CPU, which records every copy the program
asks for (`h2d-copy` tallies: pinned, non_blocking, bytes, the user's line).
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Iterable

import numpy as np

from auditor.evidence import model as m
from auditor.evidence.frame import Frame
from auditor.evidence.trace.model import Trace
from auditor.evidence.trace.names import SYNC_CALLS
from auditor.evidence.trace.queries import frame_location_parts, issuing_op, sites
from auditor.findings import Cost, Edit, Finding, Fix, Location
from auditor.fixes import edit_call_kwargs, edit_calls_on_line
from auditor.rules._support.places import by_place, locations, steps_run
from auditor.rules._support.text import line_ref, per_step, sites_text, size_text
from auditor.rules.base import Option, Options, Rule
from auditor.rules.suppression import unsuppressed

# The copy records CUPTI names by the host memory's kind: `Memcpy HtoD (Pinned -> Device)`.
PINNED_HTOD = re.compile(r"HtoD.*Pinned")
DTOH = re.compile(r"DtoH")

COUNTED = "counted, not timed: rehearsed on the CPU, where no copy crosses a bus"
# the copies whose call takes a non_blocking keyword (torch.tensor(..., device="cuda") does not)
_TAKES_NON_BLOCKING = {"Tensor.to(cuda)": ("to",), "Tensor.cuda": ("cuda",)}


class BlockingPinnedCopy(Rule):
    """
    What it detects:
        Host-to-device copies of pinned tensors (a `DataLoader(pin_memory=True)` batch,
        `t.pin_memory()`) made without `non_blocking=True`, in most steps. Seen in CUDA rehearsal,
        which records every copy the program asks for with whether its source was pinned.

        In a profiler trace recorded on a GPU: each `Memcpy HtoD (Pinned -> Device)` whose operator
        (the `aten::copy_` its `cudaMemcpyAsync` ran in) synchronised the stream after it
        (`cudaStreamSynchronize`, as torch's copy does for `non_blocking=False`; a synchronous
        `cudaMemcpy` too), with the bytes, the host's wait in those syncs per step (measured) and
        the user's line when the trace records Python stacks. Pinned copies made with
        `non_blocking=True` launch the copy and return: they are not counted.

    Why it costs:
        Pinning exists so the copy can run asynchronously: with `non_blocking=True` the host queues
        the DMA and goes on launching kernels while the batch crosses the bus. Without it the host
        waits for each copy to finish, so the pinning (and the page-locked memory it takes) buys
        no overlap.

    Example:
        loader = DataLoader(ds, batch_size=256, pin_memory=True)
        for x, y in loader:
            x = x.to("cuda")                     # blocks until the copy is done

    Fix:
        `x.to("cuda", non_blocking=True)` (the patch adds the keyword). Reading the copied tensor
        on the host right after it (`.item()`, `.cpu()`) still waits, as it must.

    Evidence needed:
        A profiler trace with CUDA activity: `audit run` on a CUDA machine (its profiler window
        records it), or `audit analyze TRACE` of a Kineto trace; or a CUDA rehearsal (`audit run` of
        CUDA code on a machine without a GPU, or `--rehearse`).
    """

    id = "blocking-pinned-copy"
    reads = frozenset({"with_stack"})  # (the user's line of a copy)
    title = "Pinned host-to-device copy without non_blocking=True"
    severity = "warning"
    category = "performance"
    needs = frozenset({"run", "trace"})
    needs_text = ("needs a profiler trace with CUDA activity (`audit run` on a GPU, `audit analyze TRACE`), or a "
                  "CUDA rehearsal (`audit run --rehearse`)")
    options = (
        Option("min-share-of-steps", 0.5, "Report a copy site only if it copies pinned memory in at least this "
                                          "share of steps."),
        Option("min-mb-per-step", 1.0, "... and the sites together move at least this many MB (1e6 bytes) per step."),
    )

    def skip_reason(self, ev: m.Evidence) -> str | None:
        """A run without a trace is judged in CUDA rehearsal only: elsewhere its copies are not recorded."""
        return None if ev.trace_data or ev.environment.rehearsal else self.needs_text

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        yield from self.trace_findings(ev, options)
        if ev.environment.rehearsal:
            yield from self.rehearsal_findings(ev, options)

    def check_trace(self, trace: Trace, options: Options) -> Finding | None:
        """One finding when the trace's blocking pinned host-to-device copies move enough bytes per step."""
        found = blocking_pinned_copies(trace)
        if not found:
            return None
        steps = trace.step_count()
        step_col = trace.col("step")
        nbytes = trace.col("bytes")
        rows = [r for r, _, _ in found]
        launches = [L for _, L, _ in found]
        copy_steps = {int(step_col[L]) for L in launches}
        if len(copy_steps) < options.min_share_of_steps * steps:
            return None
        total = int(np.clip(nbytes[rows], 0, None).sum())
        if total / steps < options.min_mb_per_step * 1e6:
            return None
        wait_ms = sum(w for _, _, w in found) / 1000.0
        where = sites(trace, launches, weights=np.clip(nbytes[rows], 0, None))
        ops = Counter(issuing_op(trace, L) or "(no operator)" for L in launches)
        at = sites_text(where, steps, sizes=True)
        return self.finding(
            "Pinned copies still block the host: pass non_blocking=True. "
            f"{per_step(len(found) / steps)} host-to-device copies per step from pinned memory "
            f"({size_text(total / steps)} per step) waited for the GPU in {trace.label}: the operator of each "
            f"({', '.join(ops)}) synchronised the stream after launching it, as a copy without non_blocking=True "
            f"does, and the host waited {wait_ms / steps:.2f} ms per step in those syncs{at}.",
            locations=[Location(*frame_location_parts(f)) for f, _, _ in where],
            evidence={"trace": str(trace.path), "copies": len(found), "copies_per_step": round(len(found) / steps, 3),
                      "bytes": total, "bytes_per_step": round(total / steps), "steps": steps,
                      "steps_with_copies": len(copy_steps), "wait_ms_per_step": round(wait_ms / steps, 3),
                      "ops": dict(ops.most_common(5)),
                      "sites": [{"file": f.file, "line": f.line, "copies": n, "bytes": int(b)} for f, n, b in where]},
            cost=Cost(ms_per_step=round(wait_ms / steps, 3), share_of_step=None,  # (trace_findings sets it)
                      measured=True, note="the host's wait in the syncs these copies made; with non_blocking=True "
                                          "the copy is queued and the host goes on"),
            fix=Fix(summary="Copy pinned tensors with .to(device, non_blocking=True), so the copy overlaps the "
                            "kernels already queued.", config={"non_blocking": True},
                    edits=_trace_edits(trace, [f for f, _, _ in where])),
        )

    def rehearsal_findings(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        """One finding for a CUDA rehearsal whose pinned copies without non_blocking move enough bytes."""
        if not ev.steps:
            return
        n = steps_run(ev)
        pairs = [(s, t) for s, t in ev.tallies(m.H2D_COPY) if t.data.get("pinned") and not t.data.get("non_blocking")]
        nbytes: dict[tuple, int] = {}
        for _, t in pairs:
            key = (t.what, t.where.file if t.where else None, t.where.line if t.where else None)
            nbytes[key] = nbytes.get(key, 0) + t.count * int(t.data.get("bytes") or 0)
        places = [p for p in by_place(pairs) if len(p.steps) >= options.min_share_of_steps * n]
        places = unsuppressed(self.id, places, lambda p: p.where)

        def size(p) -> int:
            return nbytes.get((p.what, p.where.file if p.where else None, p.where.line if p.where else None), 0)

        total = sum(size(p) for p in places)
        if not places or total / n < options.min_mb_per_step * 1e6:
            return
        copies = sum(p.count for p in places)
        first = places[0].where.file if places[0].where else None
        edits = []
        for p in places:
            names = _TAKES_NON_BLOCKING.get(p.what)
            if names and p.where and p.where.file:
                edit = edit_call_kwargs(p.where.file, p.where.line, names, {"non_blocking": "True"})
                if edit and edit not in edits:
                    edits.append(edit)
        yield self.finding(
            "Pinned copies would block the host: pass non_blocking=True. "
            f"On the GPU these copies block the host although their source is pinned: {per_step(copies / n)} "
            f"host-to-device copies per step of pinned tensors ({size_text(total / n)} per step) without "
            "non_blocking=True, at "
            + "; ".join(f"{p.what} x{per_step(p.count / n)}/step ({size_text(size(p) / n)}) at "
                        f"{line_ref(p.where.file if p.where else None, p.where.line if p.where else None, first)}"
                        for p in places[:5]) + ".",
            locations=locations(places),
            evidence={"copies_per_step": round(copies / n, 2), "bytes_per_step": round(total / n), "steps": n,
                      "sites": [{"what": p.what, "file": p.where.file if p.where else None,
                                 "line": p.where.line if p.where else None, "copies": p.count, "bytes": size(p),
                                 "steps": len(p.steps)} for p in places]},
            cost=Cost(ms_per_step=None, share_of_step=None, measured=False, note=COUNTED),
            fix=Fix(summary="Copy pinned tensors with .to(device, non_blocking=True), so the copy overlaps the "
                            "kernels already queued.", config={"non_blocking": True}, edits=edits),
        )


def blocking_pinned_copies(trace: Trace) -> list[tuple[int, int, float]]:
    """[(copy row, its launch call's row, the host's wait in us)] for every pinned host-to-device
    copy whose operator waited for it: the launch is a synchronous call (`cudaMemcpy`), or a sync
    call (SYNC_CALLS) in the same operator began after the launch (the `cudaStreamSynchronize` of
    torch's `memcpy_and_sync`). The wait is the time in those calls. The auditor's own calls are
    left out."""
    copies = trace.matching(PINNED_HTOD, trace.of("memcpy")).index.to_numpy()
    if not len(copies):
        return []
    link, parent, ts, dur = trace.col("link"), trace.col("parent"), trace.col("ts"), trace.col("dur")
    syncs = trace.named(SYNC_CALLS, trace.of("runtime", "driver")).index.to_numpy()
    sync_codes = set(trace.col("name")[syncs].tolist())
    by_parent: dict[int, list[int]] = {}
    for r in syncs.tolist():
        by_parent.setdefault(int(parent[r]), []).append(r)
    mine = trace.auditor_rows() if len(trace.auditor_ranges()) else None
    out = []
    for r in copies.tolist():
        launch = int(link[r])
        if launch < 0 or (mine is not None and mine[launch]):
            continue
        if int(trace.col("name")[launch]) in sync_codes:
            out.append((r, launch, float(dur[launch])))
            continue
        p = int(parent[launch])
        after = [s for s in by_parent.get(p, ()) if p >= 0 and ts[s] >= ts[launch]]
        if after:
            out.append((r, launch, float(sum(dur[s] for s in after))))
    return out


def _trace_edits(trace: Trace, frames: list[Frame]) -> list[Edit]:
    """non_blocking=True on the `.to()` / `.cuda()` calls of the lines the copies came from, when
    the file is on this disk (an `audit run` trace) and the trace has no device-to-host copy from
    the same line (non_blocking there would hand the host a result before it is written)."""
    dtoh = trace.matching(DTOH, trace.of("memcpy")).index.to_numpy()
    back = {(f.file, f.line) for f in (trace.user_frame(int(r)) for r in dtoh.tolist()) if f is not None}
    edits: list[Edit] = []
    for f in frames:
        if not f.file or (f.file, f.line) in back:
            continue
        edit = edit_calls_on_line(f.file, f.line, {"to": 2, "cuda": 2}, {"non_blocking": "True"})
        if edit and edit.lines and edit not in edits:
            edits.append(edit)
    return edits
