"""pageable-copy: host<->device copies staged through pageable (unpinned) host memory.

The trace half reads the staged copies a profiler trace recorded on a GPU. The rehearsal half
judges a CUDA rehearsal on the CPU, where no copy crosses a bus: the rehearsal records every
`.cuda()` / `.to("cuda")` / `copy_` into a GPU tensor the program asks for (`h2d-copy` tallies:
bytes, pinned, non_blocking, the user's line, the DataLoader the tensor came from), and this half
counts those whose source was not pinned. Both halves share `min-mb-per-step`. Counted, never
timed: a CPU has no copy to time.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from auditor.evidence import model as m
from auditor.evidence.frame import Frame
from auditor.evidence.trace.model import Trace
from auditor.evidence.trace.queries import frame_location_parts, issuing_op, sites
from auditor.rules.base import Option, Options, Rule
from auditor.findings import Cost, Edit, Finding, Fix, Location, share_of_step, step_basis_ms
from auditor.fixes import call_site, computed_kwargs, edit_call_kwargs, given_elsewhere
from auditor.rules._support.copies import non_blocking_edits
from auditor.rules._support.frameworks import framework_moves_batches, trains_with
from auditor.rules._support.host_built import host_built
from auditor.rules._support.places import place_key, steps_run
from auditor.rules._support.gpu_costs import copy_cost
from auditor.rules._support.text import line_ref, per_step, size_text
from auditor.rules.suppression import unsuppressed

_DIRECTIONS = {"HtoD": "host-to-device", "DtoH": "device-to-host"}


COUNTED = "counted, not timed: rehearsed on the CPU, where no copy crosses a bus"


@dataclass
class _Site:
    where: Frame | None
    what: str
    steps: set[int] = field(default_factory=set)
    copies: int = 0
    bytes: int = 0
    non_blocking: int = 0  # copies asking for non_blocking=True (which pageable memory ignores)
    loaders: set[int] = field(default_factory=set)


def _sites(ev: m.Evidence) -> list[_Site]:
    """The unpinned copies by place; those of a tensor the code just built on the host are
    host-built-tensor's (made on the device, not pinned: rules._support.host_built)."""
    sites: dict[tuple, _Site] = {}
    built: dict[tuple, bool] = {}
    for step, t in ev.tallies(m.H2D_COPY):
        if t.data.get("pinned"):
            continue
        at = (t.where.file, t.where.line) if t.where else (None, None)
        if at not in built:
            built[at] = host_built(*at) is not None
        if built[at]:
            continue
        key = place_key(t)
        s = sites.setdefault(key, _Site(where=t.where, what=t.what))
        s.steps.add(step)
        s.copies += t.count
        s.bytes += t.count * int(t.data.get("bytes") or 0)
        s.non_blocking += t.count if t.data.get("non_blocking") else 0
        if t.data.get("loader") is not None:
            s.loaders.add(int(t.data["loader"]))
    return sorted(sites.values(), key=lambda s: -s.bytes)


def rehearsal_findings(rule: Rule, evidence: m.Evidence, options: Options) -> list[Finding]:
    """One finding for the run when unpinned host->device copies move enough bytes per step."""
    if not evidence.steps:
        return []
    n = steps_run(evidence)
    sites = [s for s in _sites(evidence) if len(s.steps) >= options.min_share_of_steps * n]
    sites = unsuppressed(rule.id, sites, lambda s: s.where)  # out of the count, message and evidence
    total = sum(s.bytes for s in sites)
    if not sites or total / n < options.min_mb_per_step * 1e6:
        return []
    copies = sum(s.copies for s in sites)
    loaders = [d for d in evidence.dataloaders if any(d.id in s.loaders for s in sites)]
    locs = [Location.of(s.where) for s in sites if s.where]
    locs += [Location.of(d.where) for d in loaders if d.where]
    ignored_nb = sum(s.non_blocking for s in sites)
    message = ("Copies to the GPU from unpinned memory: pin the batches. "
               f"On the GPU these copies are staged through pageable memory: {per_step(copies / n)} host-to-device "
               f"copies per step of unpinned tensors move {size_text(total / n)} per step, at "
               + "; ".join(f"{s.what} x{per_step(s.copies / n)}/step ({size_text(s.bytes / n)}) at "
                           + line_ref(s.where.file if s.where else None, s.where.line if s.where else None,
                                      locs[0].file if locs else None) for s in sites[:5])
               + (f"; {per_step(ignored_nb / n)} per step ask for non_blocking=True, which pageable memory turns "
                  "into a blocking copy" if ignored_nb else "")
               + ".")
    unpinned_loaders = [d for d in loaders if not d.settings.get("pin_memory")]
    edits, computed = _pin_edits(unpinned_loaders)
    # the step's copies of those batches, made non_blocking as the advice says (rules._support.copies)
    edits += non_blocking_edits(evidence, [d.id for d in unpinned_loaders])
    fabric = framework_moves_batches(trains_with([*(d.where.file for d in loaders if d.where), evidence.target]))
    summary = ("Pin the batches: DataLoader(..., pin_memory=True)" if unpinned_loaders else
               "Pin the host tensors (tensor.pin_memory(), or build them in a DataLoader with "
               "pin_memory=True)") + (f"; {fabric}." if fabric and unpinned_loaders else
                                      ", then copy with .to('cuda', non_blocking=True) so the copy overlaps compute.")
    if computed:  # a patch hard-coding it would leave the user's config entry dead
        summary += (" The DataLoader at " + ", ".join(f"line {line} takes pin_memory from {src}"
                                                    for line, src in computed)
                    + ": set it to True there; the patch leaves that call alone.")
    return [rule.finding(
        message,
        locations=locs,
        evidence={"copies": copies, "copies_per_step": round(copies / n, 3), "bytes": total,
                  "bytes_per_step": round(total / n), "steps": n, "non_blocking_ignored": ignored_nb,
                  "rehearsal": evidence.environment.rehearsal,
                  "sites": [{"what": s.what, "file": s.where.file if s.where else None,
                             "line": s.where.line if s.where else None, "copies": s.copies, "bytes": s.bytes,
                             "steps": len(s.steps), "non_blocking": s.non_blocking} for s in sites],
                  "dataloaders": [{"id": d.id, "line": d.where.line if d.where else None,
                                   "pin_memory": d.settings.get("pin_memory")} for d in loaders]},
        cost=copy_cost(evidence, total / n) if evidence.environment.rehearsal else
        Cost(ms_per_step=None, share_of_step=None, measured=False, note=COUNTED),
        # Pinning changes where a batch lives on the host, not its values: the edit is fixes.patch's.
        fix=Fix(summary=summary, config={"DataLoader.pin_memory": True, "non_blocking": True}, edits=edits),
    )]


def _pin_edits(loaders: list[m.DataLoaderInfo]) -> tuple[list[Edit], list[tuple[int, str]]]:
    """Edits adding pin_memory=True to the unpinned loaders' DataLoader calls in the user's file, and
    the (line, source) of calls that read pin_memory from an expression, which are left alone."""
    edits: list[Edit] = []
    computed: list[tuple[int, str]] = []
    for d in loaders:
        if not d.where or not d.where.file:
            continue
        src = {k: f"`{v}`" for k, v in computed_kwargs(d.where.file, d.where.line, ("DataLoader",),
                                                        ("pin_memory",)).items()}
        site = call_site(d.where.file, d.where.line, ("DataLoader",))
        if not src and site is not None:  # given through `**mapping`: set it where that is made
            src = given_elsewhere(site, ("pin_memory",), d.passed)
        if src:
            computed.append((d.where.line, src["pin_memory"]))
            continue
        edit = edit_call_kwargs(d.where.file, d.where.line, ("DataLoader",), {"pin_memory": "True"},
                                received=d.passed)
        if edit and edit not in edits:
            edits.append(edit)
    return edits, computed


class PageableCopy(Rule):
    """
    What it detects:
        `Memcpy HtoD (Pageable -> Device)` and `Memcpy DtoH (Device -> Pageable)` records in a profiler
        trace: tensors copied between the GPU and ordinary host memory, with how many bytes and how much
        GPU time they took per step, and the source lines that issued them.

    Why it costs:
        The GPU can only DMA from page-locked memory, so the driver first copies a pageable buffer into
        a pinned staging buffer, in pieces, with the host thread waiting. Such a copy runs at a fraction
        of the bus bandwidth, cannot overlap compute, and turns `non_blocking=True` into a blocking call.

    Example:
        loader = DataLoader(ds, batch_size=256)          # batches in pageable memory
        for x, y in loader:
            x = x.to("cuda")                             # staged, synchronous copy

    Fix:
        `DataLoader(..., pin_memory=True)` and `x.to("cuda", non_blocking=True)`; for results copied
        back, copy into a buffer made with `torch.empty(..., pin_memory=True)`.

    Evidence needed:
        A profiler trace with CUDA activity (`audit run` with profiling, or `audit analyze TRACE`).
    """

    id = "pageable-copy"
    title = "Host-device copy from pageable memory"
    severity = "warning"
    needs = frozenset({"run", "trace"})
    needs_text = "needs a profiler trace with CUDA activity, or a CUDA rehearsal (`audit run --rehearse`)"
    options = (
        Option("min-mb-per-step", 1.0,
               "Report a copy direction when it moves at least this many MB (1e6 bytes) per step "
               "through pageable memory; below it the staging cost is noise."),
        Option("min-share-of-steps", 0.5,
               "Rehearsal: report a copy site only if it copies unpinned memory in at least this share of steps."),
    )

    def skip_reason(self, evidence: m.Evidence) -> str | None:
        """A run without a trace is judged in CUDA rehearsal only: elsewhere its copies are not recorded."""
        return None if evidence.trace_data or evidence.environment.rehearsal else self.needs_text

    def check(self, evidence: m.Evidence, options: Options) -> Iterator[Finding]:
        yield from self.trace_findings(evidence, options)
        yield from rehearsal_findings(self, evidence, options)

    def trace_findings(self, evidence: m.Evidence, options: Options) -> Iterator[Finding]:
        """Per recorded trace, one finding per copy direction that moves enough bytes per step."""
        for trace in evidence.trace_data:
            yield from self._check_trace(trace, options, step_basis_ms(evidence, trace))

    def _check_trace(self, trace: Trace, options: Options, step_ms: float | None) -> Iterator[Finding]:
        copies = trace.matching(r"Pageable", trace.of("memcpy"))
        if not len(copies):
            return
        names = trace.names(copies)
        steps = trace.step_count()
        min_bytes = options.min_mb_per_step * 1e6
        link = trace.events["link"].to_numpy()
        host_dur = trace.events["dur"].to_numpy()
        for short, label in _DIRECTIONS.items():
            mask = np.array([short in n for n in names], dtype=bool)
            sel = copies[mask]
            if not len(sel):
                continue
            nbytes = int(np.clip(sel["bytes"].to_numpy(), 0, None).sum())
            if nbytes / steps < min_bytes:
                continue
            gpu_ms = float(sel["dur"].sum()) / 1000.0
            launches = link[sel.index.to_numpy()]
            host_ms = float(host_dur[launches[launches >= 0]].sum()) / 1000.0
            rows = sel.index.to_numpy()
            ops = Counter(issuing_op(trace, int(r)) or "(no operator)" for r in rows)
            where = sites(trace, rows, weights=np.clip(sel["bytes"].to_numpy(), 0, None))
            per_step_ms = round(gpu_ms / steps, 3)
            side = "to" if label.startswith("device-to-host") else "from"  # (pageable is the host end)
            opening = ("Copies from the GPU into unpinned memory: copy into pinned buffers. " if side == "to" else
                       "Copies to the GPU from unpinned memory: pin the batches. ")
            message = (opening + f"{len(sel)} {label} copies {side} pageable memory moved {size_text(nbytes)} "
                       f"({size_text(nbytes / steps)} per step) in {trace.label}, taking "
                       f"{per_step_ms:.2f} ms of GPU copy time per step; the host waited "
                       f"{host_ms / steps:.2f} ms per step in the copy calls.")
            yield self.finding(
                message,
                locations=[Location(*frame_location_parts(f)) for f, _, _ in where],
                evidence={"trace": str(trace.path), "direction": short, "copies": len(sel),
                          "copies_per_step": len(sel) / steps, "bytes": nbytes, "bytes_per_step": nbytes / steps,
                          "largest_copy_bytes": int(sel["bytes"].max()), "gpu_ms": round(gpu_ms, 3),
                          "host_ms": round(host_ms, 3), "steps": steps,
                          "run_step_ms": round(step_ms, 3) if step_ms else None,
                          "ops": dict(ops.most_common(5)),
                          "sites": [{"file": f.file, "line": f.line, "copies": n, "bytes": int(b)}
                                    for f, n, b in where]},
                cost=Cost(ms_per_step=round(per_step_ms, 3), measured=True, share_of_step=share_of_step(per_step_ms, step_ms),
                          note="GPU time of the staged copies; the host also blocks in them"),
                fix=Fix(summary="Pin the host side: DataLoader(pin_memory=True) and "
                                ".to(device, non_blocking=True); copy results back into a pinned buffer.",
                        config={"pin_memory": True, "non_blocking": True}),
            )
