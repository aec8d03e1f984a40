"""blocking-pinned-copy: host-to-device copies from pinned memory made without non_blocking=True."""
from __future__ import annotations

from typing import Iterable

from auditor.evidence import model as m
from auditor.findings import Cost, Finding, Fix
from auditor.fixes import edit_call_kwargs
from auditor.rules._support.places import by_place, locations, steps_run
from auditor.rules._support.text import line_ref, per_step, size_text
from auditor.rules.base import Option, Options, Rule
from auditor.rules.suppression import unsuppressed

COUNTED = "counted, not timed: rehearsed on the CPU, where no copy crosses a bus"
# the copies whose call takes a non_blocking keyword (torch.tensor(..., device="cuda") does not)
_TAKES_NON_BLOCKING = {"Tensor.to(cuda)": ("to",), "Tensor.cuda": ("cuda",)}


class BlockingPinnedCopy(Rule):
    """
    What it detects:
        Host-to-device copies of pinned tensors (a `DataLoader(pin_memory=True)` batch,
        `t.pin_memory()`) made without `non_blocking=True`, in most steps. Seen in CUDA rehearsal,
        which records every copy the program asks for with whether its source was pinned.

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
        A CUDA rehearsal (`audit run` of CUDA code on a machine without a GPU, or `--rehearse`).
    """

    id = "blocking-pinned-copy"
    title = "Pinned host-to-device copy without non_blocking=True"
    severity = "warning"
    category = "performance"
    needs = frozenset({"run"})
    options = (
        Option("min-share-of-steps", 0.5, "Report a copy site only if it copies pinned memory in at least this "
                                          "share of steps."),
        Option("min-mb-per-step", 1.0, "... and the sites together move at least this many MB (1e6 bytes) per step."),
    )

    def skip_reason(self, ev: m.Evidence) -> str | None:
        return None if ev.environment.rehearsal else "needs a CUDA rehearsal (host-to-device copies are counted there)"

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
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
