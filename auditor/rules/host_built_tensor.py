"""host-built-tensor: a tensor built on the host every step and copied to the GPU.

Read from a CUDA rehearsal's `h2d-copy` tallies (every copy to the GPU the program asks for, at the
user's line) and the source at each copy's line (rules._support.host_built): what is copied was
just made there by a torch factory on the host (`torch.ones(bs, 1).to(device)`,
`torch.randn(bs, latent).to(device)`) or drawn by NumPy into a legacy CUDA type
(`Tensor(np.random.normal(...))`).
"""
from __future__ import annotations

from collections.abc import Iterator

from auditor.evidence import model as m
from auditor.findings import Cost, Finding, Fix
from auditor.rules._support.gpu_costs import copy_cost, sync_cost
from auditor.rules._support.host_built import HostBuilt, host_built
from auditor.rules._support.places import by_place, locations, steps_run
from auditor.rules._support.text import line_ref, per_step
from auditor.rules.base import Option, Options, Rule
from auditor.rules.suppression import unsuppressed

RANDOM_NOTE = ("a random draw made on the device comes from the device's generator: its numbers differ from the "
               "host draw's (and the host generator's later draws shift), so the run's results change. ")


class HostBuiltTensor(Rule):
    """
    What it detects:
        In a CUDA rehearsal, a tensor the step builds on the host and copies to the GPU at once,
        step after step: `torch.ones(batch_size, 1).to(device)` (labels), `torch.randn(batch_size,
        latent).to(device)` (noise), a name bound to such a factory earlier in the same loop body
        and copied later (`z = torch.randn(...)` ... `z.to(device)`), or a legacy CUDA type given a
        NumPy draw (`Tensor(np.random.normal(0, 1, (n, d)))`, PyTorch-GAN's noise).

    Why it costs:
        Each one is a host allocation (and, for noise, a draw on the host's generator) and a copy
        from pageable memory, which torch makes blocking: without `non_blocking=True` it synchronises
        the stream after the copy, so the host waits for every kernel queued before it, every step.
        Made on the device, it is one kernel launch and no copy.

    Example:
        for imgs, _ in loader:
            real = torch.ones(imgs.size(0), 1).to(device)
            z = torch.randn(imgs.size(0), latent_dim).to(device)

    Fix:
        Make it on the device: `torch.ones(imgs.size(0), 1, device=device)`, `torch.randn(imgs.size(0),
        latent_dim, device=device)`; a legacy type's draw with its own method,
        `Tensor(n, d).normal_(0, 1)`. A constant whose shape does not change can also be made once
        before the loop (a last, smaller batch changes the shape). The patch adds `device=` to the
        factory (the copy's own device expression), dropping the chained copy. A random draw made on
        the device comes from the device's generator, so its numbers differ from the host draw's:
        that edit is marked in fixes.patch as one that changes results; a constant keeps its
        values exactly.

    Evidence needed:
        A CUDA rehearsal (`audit run` of a CUDA program on a machine without a GPU): its copies to the
        GPU and the source of their lines. Cost: the device model's estimate of a blocking copy's
        sync (a round trip, a lower bound: the queue it waits for is not known in a rehearsal), or
        of a non-blocking copy's bytes.
    """

    id = "host-built-tensor"
    title = "A tensor built on the host every step and copied to the GPU"
    severity = "warning"
    category = "performance"
    needs = frozenset({"run"})
    needs_text = "needs a CUDA rehearsal (`audit run` of a CUDA program on a machine without a GPU)"
    options = (
        Option("min-share-of-steps", 0.5, "Report a copy only if it copies a host-built tensor in at least this share "
                                          "of steps."),
    )

    def skip_reason(self, evidence: m.Evidence) -> str | None:
        return None if evidence.environment.rehearsal else self.needs_text

    def check(self, evidence: m.Evidence, options: Options) -> Iterator[Finding]:
        """One finding for the host-built constants, one for the host-built random draws (their
        fix changes the numbers drawn: marked so in fixes.patch)."""
        if not evidence.steps or not evidence.environment.rehearsal:
            return
        n = steps_run(evidence)
        places = [p for p in by_place(evidence.tallies(m.H2D_COPY)) if len(p.steps) >= options.min_share_of_steps * n]
        built = {id(p): host_built(p.where.file, p.where.line) for p in places if p.where}
        places = unsuppressed(self.id, [p for p in places if built.get(id(p))], lambda p: p.where)
        for random in (False, True):
            group = [p for p in places if built[id(p)].random is random]  # type: ignore[union-attr]
            if group:
                yield self._finding(evidence, n, group, {id(p): built[id(p)] for p in group}, random)  # type: ignore[misc]

    def _finding(self, ev: m.Evidence, n: int, places: list, made: dict[int, HostBuilt], random: bool) -> Finding:
        first = places[0].where.file if places[0].where else None
        copies = sum(p.count for p in places)
        blocking = sum(p.count for p in places if not p.data.get("non_blocking"))
        nbytes = sum(p.count * int(p.data.get("bytes") or 0) for p in places)
        kind = "random draws" if random else "constants"
        message = (("Random draws are made on the CPU: draw them on the GPU. " if random else
                    "Constants are built on the CPU: make them on the GPU. ")
                   + f"{per_step(copies / n)} {kind} per step built on the host and copied to the GPU: "
                   + ", ".join(f"{made[id(p)].made} at {line_ref(p.where.file if p.where else None, made[id(p)].line, first)}"
                               for p in places[:4]) + ".")
        edits = []
        for e in (made[id(p)].edit for p in places):
            if e is not None and e not in edits:
                edits.append(e)
        if random:
            summary = ("Draw them on the device: `torch.randn(..., device=device)` (the factory given the copy's own "
                       "device), a legacy type's draw with its own method (`Tensor(n, d).normal_(0, 1)` for "
                       "`Tensor(np.random.normal(0, 1, (n, d)))`). " + RANDOM_NOTE.capitalize()
                       + "fixes.patch marks it for review.")
        else:
            summary = ("Make them on the device: `torch.ones(..., device=device)` (the factory given the copy's own "
                       "device), or, where the shape does not change, once before the loop (a last, smaller batch "
                       "changes it). Their values stay exactly what they were.")
        cost = (sync_cost(ev, blocking / n, "blocking host-to-device copy") if blocking
                else copy_cost(ev, nbytes / n))
        return self.finding(
            message,
            locations=locations(places),
            evidence={"built": kind, "copies_per_step": round(copies / n, 3),
                      "blocking_per_step": round(blocking / n, 3), "bytes_per_step": round(nbytes / n), "steps": n,
                      "sites": [{"what": p.what, "file": p.where.file if p.where else None,
                                 "line": p.where.line if p.where else None, "made_by": made[id(p)].made,
                                 "made_at": made[id(p)].line, "copies": p.count, "steps": len(p.steps),
                                 "patched": made[id(p)].edit is not None} for p in places]},
            cost=cost,
            fix=Fix(summary=summary, config={}, edits=edits, changes_numerics=random),
        )
