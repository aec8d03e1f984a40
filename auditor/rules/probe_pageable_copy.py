"""The probe half of pageable-copy: host->device copies of unpinned tensors, seen in CUDA rehearsal.

The PageableCopy rule (owned elsewhere) calls `probe_pageable_copy_findings(self, evidence, options)`
and adds `PROBE_OPTIONS` to its options; it shares the trace half's `min-mb-per-step`. On a GPU the
trace shows the staged copies; in a rehearsal on the CPU no copy crosses a bus, so the rehearsal
records every `.cuda()` / `.to("cuda")` / `copy_` into a GPU tensor the program asks for (`h2d-copy`
tallies: bytes, pinned, non_blocking, the user's line, the DataLoader the tensor came from) and
this half counts those whose source was not pinned. Counted, never timed: a CPU has no copy to time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from auditor.evidence import model as m
from auditor.rules.base import Option
from auditor.findings import Cost, Edit, Finding, Fix, Location
from auditor.fixes import computed_kwargs, edit_call_kwargs
from auditor.rules._support.places import place_key, steps_run
from auditor.rules._support.text import line_ref, per_step, size_text
from auditor.rules.suppression import unsuppressed

PROBE_OPTIONS: tuple[Option, ...] = (
    Option("min-share-of-steps", 0.5,
           "Rehearsal: report a copy site only if it copies unpinned memory in at least this share of steps."),
)
COUNTED = "counted, not timed: rehearsed on the CPU, where no copy crosses a bus"


@dataclass
class _Site:
    where: m.Frame | None
    what: str
    steps: set[int] = field(default_factory=set)
    copies: int = 0
    bytes: int = 0
    non_blocking: int = 0  # copies asking for non_blocking=True (which pageable memory ignores)
    loaders: set[int] = field(default_factory=set)


def _sites(ev: m.Evidence) -> list[_Site]:
    sites: dict[tuple, _Site] = {}
    for step, t in ev.tallies(m.H2D_COPY):
        if t.data.get("pinned"):
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


def probe_pageable_copy_findings(rule: Any, evidence: m.Evidence, options: dict[str, Any]) -> list[Finding]:
    """One finding for the run when unpinned host->device copies move enough bytes per step."""
    if not evidence.steps:
        return []
    n = steps_run(evidence)
    sites = [s for s in _sites(evidence) if len(s.steps) >= options.get("min-share-of-steps", 0.5) * n]
    sites = unsuppressed(rule.id, sites, lambda s: s.where)  # out of the count, message and evidence
    total = sum(s.bytes for s in sites)
    if not sites or total / n < float(options.get("min-mb-per-step", 1.0)) * 1e6:
        return []
    copies = sum(s.copies for s in sites)
    loaders = [d for d in evidence.dataloaders if any(d.id in s.loaders for s in sites)]
    locs = [Location.of(s.where) for s in sites if s.where]
    locs += [Location.of(d.where) for d in loaders if d.where]
    ignored_nb = sum(s.non_blocking for s in sites)
    message = (f"On the GPU these copies are staged through pageable memory: {per_step(copies / n)} host-to-device "
               f"copies per step of unpinned tensors move {size_text(total / n)} per step, at "
               + "; ".join(f"{s.what} x{per_step(s.copies / n)}/step ({size_text(s.bytes / n)}) at "
                           + line_ref(s.where.file if s.where else None, s.where.line if s.where else None,
                                      locs[0].file if locs else None) for s in sites[:5])
               + (f"; {per_step(ignored_nb / n)} per step ask for non_blocking=True, which pageable memory turns "
                  "into a blocking copy" if ignored_nb else "")
               + ".")
    unpinned_loaders = [d for d in loaders if not d.settings.get("pin_memory")]
    edits, computed = _pin_edits(unpinned_loaders)
    summary = ("Pin the batches: DataLoader(..., pin_memory=True)" if unpinned_loaders else
               "Pin the host tensors (tensor.pin_memory(), or build them in a DataLoader with "
               "pin_memory=True)") + ", then copy with .to('cuda', non_blocking=True) so the copy overlaps compute."
    if computed:  # a patch hard-coding it would leave the user's config entry dead
        summary += (" The DataLoader at " + ", ".join(f"line {line} takes pin_memory from `{src}`"
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
        cost=Cost(ms_per_step=None, share_of_step=None, measured=False, note=COUNTED),
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
        src = computed_kwargs(d.where.file, d.where.line, ("DataLoader",), ("pin_memory",))
        if src:
            computed.append((d.where.line, src["pin_memory"]))
            continue
        edit = edit_call_kwargs(d.where.file, d.where.line, ("DataLoader",), {"pin_memory": "True"})
        if edit and edit not in edits:
            edits.append(edit)
    return edits, computed
