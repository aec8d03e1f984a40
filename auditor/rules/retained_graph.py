"""retained-graph: backward(retain_graph=True) whose graph is never backpropagated again."""
from __future__ import annotations

from typing import Any, Iterable

from auditor.evidence import model as m
from auditor.rules.base import Options, Rule
from auditor.findings import Cost, Finding, Fix, Location
from auditor.rules._support.places import by_place, place_key
from auditor.fixes import edit_call_kwargs


class RetainedGraph(Rule):
    """
    What it detects:
        `loss.backward(retain_graph=True)` or `torch.autograd.grad(..., retain_graph=True)` where no
        later backward in the same step runs through the retained graph before it is dropped; or
        where the next step's backward runs into it (a tensor carried across steps holds it).

    Why it costs:
        retain_graph keeps every activation the graph saved alive until the graph itself dies. Used
        "to make an error go away" in gradient accumulation, it multiplies activation memory by the
        number of micro-batches and is a classic cause of "OOM on the second batch".

    Example:
        bad:   for x in micro_batches: model(x).loss.backward(retain_graph=True)
        good:  for x in micro_batches: model(x).loss.backward()

    Fix:
        Drop `retain_graph=True`. If that raises "Trying to backward through the graph a second
        time", a tensor from an earlier step is reused: detach it (e.g. an RNN hidden state).
        Where the next step's backward ran into a graph kept here (a state carried across steps
        and not detached), the finding says so and offers no patch: detach the state instead.
        Where some of the line's graphs are backpropagated again (a state carried from one
        micro-batch to the next), no patch is offered: dropping the flag would break those calls;
        keep it for them only (`retain_graph=(micro < accum_steps - 1)`) or detach the state.

    Evidence needed:
        A run: the backward probes hook each node of a retained graph and note whether any later
        backward in the step ran through it.
    """

    id = "retained-graph"
    title = "retain_graph=True keeps a graph nobody backpropagates again"
    severity = "warning"
    category = "memory"
    needs = frozenset({"run"})
    options = ()

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        pairs = ev.tallies(m.RETAINED_UNUSED)
        at_once: dict[tuple, int | None] = {}  # per place: most graphs alive together (None: unknown)
        for _, t in pairs:
            key = place_key(t)
            n = t.data.get("alive_at_once")
            at_once[key] = None if n is None or at_once.get(key, 0) is None else max(n, at_once.get(key, 0))
        retaining: dict[tuple, int] = {}  # per place: backward calls made with retain_graph=True
        for _, t in ev.tallies(m.BACKWARD):
            if t.data.get("retain_graph"):
                key = place_key(t)
                retaining[key] = retaining.get(key, 0) + t.count
        carried = {place_key(p): p.count for p in by_place(ev.tallies(m.RETAINED_CARRIED))}
        for p in by_place(pairs):
            per_step = p.count / max(1, len(p.steps))
            calls = retaining.get(place_key(p), 0)
            if carried.get(place_key(p)):
                yield self._carried(p, carried[place_key(p)], calls)
                continue
            saved_mb = p.data.get("saved_bytes", 0) / 2**20
            # (saved values that saved-tensor hooks packed, activation checkpointing's, are not read:
            # the figures are then lower bounds)
            least = "at least " if p.data.get("saved_partial") else ""
            more = " or more" if least else ""
            alive = at_once.get(place_key(p))
            if alive:
                freed = saved_mb * alive
                held = (f"memory: {least}{freed:.2f} MiB of saved activations held past their backward "
                        f"({alive} graph{'s' if alive > 1 else ''} alive at once)")
            else:  # (the graphs' lifetimes were not seen: at most every graph of a step at once)
                freed = saved_mb * per_step
                held = f"memory: up to {freed:.2f} MiB{more} of saved activations held past their backward"
            # Its predicted saving is that memory; of step time, none: the graphs are freed a step
            # later either way, and held memory costs time only once the device runs short of it
            amount = f"{least}{freed:.2f} MiB" if alive else f"up to {freed:.2f} MiB{more}"
            saving = (f"Its fix frees {amount} per step; it saves no step time "
                      "that can be predicted (the graphs are freed a step later either way; held memory costs time "
                      "only once the device runs short of it)")
            loc = [Location.of(p.where)] if p.where else []
            # Some of this line's graphs were backpropagated again (gradient accumulation through a
            # state carried from one micro-batch to the next): dropping retain_graph there raises
            # "Trying to backward through the graph a second time". No patch then; the summary says how.
            reused = calls - p.count if calls > p.count else 0
            edit = edit_call_kwargs(p.where.file, p.where.line, ("backward", "grad"), drop=("retain_graph",)) \
                if p.where and not reused else None
            summary = ("Remove retain_graph=True; detach state reused across steps instead." if not reused else
                       f"Keep retain_graph=True only for the calls whose graph a later backward uses ({reused} of "
                       f"{calls} calls here), e.g. retain_graph=(micro < accum_steps - 1), or detach the state "
                       "carried between them; removing it outright would make those later backwards fail.")
            yield self.finding(
                ("retain_graph=True keeps graphs no backward uses: remove it. " if not reused else
                 "retain_graph=True keeps graphs no backward uses: keep it only where needed. ")
                + f"The call {p.what}(retain_graph=True) kept {p.count} graphs alive that no later backward used "
                f"({per_step:.1f} per step in {len(p.steps)} steps, ~{p.data.get('graph_nodes', 0)} autograd "
                f"nodes and {least}{saved_mb:.2f} MiB of saved tensors each"
                + ("; values packed by saved-tensor hooks, activation checkpointing's, not counted" if least else "")
                + (f"; at most {alive} alive at once" if alive else "") + "). " + saving + ".",
                locations=loc,
                evidence={"retained_unused": p.count, "steps": len(p.steps), "per_step": round(per_step, 2),
                          "graph_nodes": p.data.get("graph_nodes", 0), "saved_bytes": p.data.get("saved_bytes", 0),
                          "saved_bytes_partial": bool(least), "alive_at_once": alive, "retaining_calls": calls,
                          "reused": reused,
                          "memory_saved_bytes": round(freed * 2**20)},
                cost=Cost(ms_per_step=None, share_of_step=None, measured=alive is not None, note=f"{held}; {saving}"),
                fix=Fix(summary=summary, config={"retain_graph": False} if not reused else {},
                        edits=[edit] if edit else []),
            )

    def _carried(self, p: Any, carried: int, calls: int) -> Finding:
        """The graphs kept here that the next step's backward ran into: the flag is there because a
        tensor carried across steps was not detached (often added after "Trying to backward through
        the graph a second time"). Dropping it alone brings that error back, so no patch."""
        total = max(calls, carried)
        graphs = (f"{carried} of the {total} graphs" if carried < total
                  else "the graph" if total == 1 else f"all {total} graphs")
        return self.finding(
            "A state carried between steps holds its graph: detach it. "
            f"The call {p.what}(retain_graph=True) kept graphs that the next step's backward ran into ({graphs} retained "
            "here): a tensor the step carries over to the next (a recurrent state, a running value) still holds "
            "the graph it was made in, so each backward goes back through earlier steps, costing more time and "
            "memory every step, and fails once the optimizer has changed weights those steps saved "
            "(\"modified by an inplace operation\").",
            locations=[Location.of(p.where)] if p.where else [],
            evidence={"carried": carried, "retaining_calls": calls, "retained_unused": max(0, p.count - carried),
                      "steps": len(p.steps), "graph_nodes": p.data.get("graph_nodes", 0),
                      "saved_bytes": p.data.get("saved_bytes", 0)},
            cost=Cost(ms_per_step=None, share_of_step=None, measured=False,
                      note="each step's graph stays reachable from the next: time and memory grow with every step"),
            fix=Fix(summary="Detach what the step carries over to the next at the step boundary (`h = h.detach()`; "
                            "an LSTM's state is a pair: detach both h and c); retain_graph=True is then not needed. "
                            "Removing the flag alone makes the next step's backward fail with \"Trying to backward "
                            "through the graph a second time\".",
                    config={}))
