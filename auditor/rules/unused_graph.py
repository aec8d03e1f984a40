"""unused-graph: a forward pass records an autograd graph that no backward pass ever uses."""
from __future__ import annotations

import statistics
from typing import Iterable

from auditor.evidence import model as m
from auditor.findings import Cost, Finding, Fix, Location
from auditor.fixes import binds_torch, parse_file, wrap_statement
from auditor.rules.base import Option, Options, Rule
from auditor.rules.suppression import suppressed_at


class _Line:
    """The graphs of the forwards made at one line: how many were freed used and unused, and the
    forward calls there in the steps and outside them."""

    def __init__(self, where: m.Frame) -> None:
        self.where, self.used, self.unused = where, 0, 0
        self.what, self.outside = "", 0
        self.per_step: dict[int, int] = {}  # forward calls in each step


def _lines(ev: m.Evidence) -> dict[tuple[str, int], _Line]:
    seen: dict[tuple[str, int], _Line] = {}
    tallies = [(-1, t) for t in ev.setup] + [(s.index, t) for s in ev.steps for t in s.tallies] + \
        [(-1, t) for o in ev.outside for t in o.tallies]
    for step, t in tallies:
        if t.where is None or t.kind not in (m.GRAPH_USE, m.FORWARD):
            continue
        line = seen.setdefault((t.where.file, t.where.line), _Line(t.where))
        if t.kind == m.FORWARD:
            line.what = line.what or t.what
            if step >= 0:
                line.per_step[step] = line.per_step.get(step, 0) + t.count
            else:
                line.outside += t.count
        elif t.what == "used":
            line.used += t.count
        else:
            line.unused += t.count
    return seen


class UnusedGraph(Rule):
    """
    What it detects:
        An outermost forward pass (a model's call) made with grad enabled whose autograd graph no
        backward pass ever ran through: every graph recorded at that line was freed unused. Typical
        places: a reinforcement learner choosing its action (`q_values = q_network(obs)`), an
        evaluation loop, a target or teacher network's forward, all outside `torch.no_grad()`.
        A model called inside a method of its own that the program's code calls (`def
        get_action(self, x): ... self(x)`, used both to act and to train) is named at the lines
        that called the method, which tell the two apart.

    Why it costs:
        Under grad mode every operation records an autograd node and keeps the tensors its backward
        would need (the activations) until the graph is freed: host time on each op, and memory
        that an evaluation loop keeping its outputs (a list of logits) holds for every batch, the
        usual "out of memory in validation". None of it is used.

    Example:
        bad:   q_values = q_network(obs)                # never backpropagated
        good:  with torch.no_grad():
                   q_values = q_network(obs)

    Fix:
        Run that forward under `torch.no_grad()` (or `torch.inference_mode()`, whose outputs cannot
        enter a later graph at all). The code patch puts the statement inside
        `with torch.no_grad():`; its results are the same numbers, without a graph. Where the
        forward's output is sometimes backpropagated (on a path the audit did not see), keep it.

    Evidence needed:
        A run (`audit run`): at the end of each outermost forward with grad enabled, outside the
        steps and in the checked and line-sampled ones, a pre-hook on its output's autograd nodes
        notes a backward pass through them; when the graph is freed, the line's graph is counted
        used or unused (capture.probes.graph_use).
    """

    id = "unused-graph"
    title = "A forward pass records an autograd graph that no backward pass uses"
    severity = "warning"
    warns_uncounted = "the unused graph holds its activations' memory until the next step"
    category = "performance"
    needs = frozenset({"run"})
    needs_text = "needs the forward passes' graphs watched in a run"
    options = (
        Option("min-unused", 3, "Graphs freed unused at a line, none used there, to flag it."),
    )

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        least = int(options["min-unused"])
        steps = [s.index for s in ev.steps]
        for line in sorted(_lines(ev).values(), key=lambda x: (-x.unused, x.where.file, x.where.line)):
            if line.used or line.unused < least:
                continue
            if suppressed_at(line.where.file, line.where.line, self.id):
                continue
            loc = Location.of(line.where)
            calls = []
            # (the median step's calls: a first step that took in a warm-up's forwards is one burst)
            per_step = statistics.median(line.per_step.get(i, 0) for i in steps) if steps else 0
            in_steps = sum(line.per_step.values())
            if per_step:
                calls.append(f"{per_step:g} call(s) in the median step")
            elif in_steps:  # (an evaluation under grad after a step's update is taken into the next step)
                calls.append(f"{in_steps} call(s) in {len(line.per_step)} of the {len(steps)} steps")
            if line.outside:
                calls.append(f"{line.outside} outside the steps (an evaluation, a rollout between updates)")
            edit = None
            parsed = parse_file(line.where.file)
            if parsed is not None and binds_torch(parsed[1]):
                edit = wrap_statement(line.where.file, line.where.line, "with torch.no_grad():")
            yield self.finding(
                "A forward records a graph nothing uses: run it under no_grad. "
                f"The forward at line {line.where.line}{f' ({line.what})' if line.what else ''} records an "
                f"autograd graph that no backward pass uses: all {line.unused} of its graphs the audit watched "
                f"were freed unused ({', '.join(calls) or 'its calls'}). Each kept the activations its backward would "
                "need until it was freed; under torch.no_grad() it would record no graph and keep nothing.",
                locations=[loc],
                evidence={"graphs_unused": line.unused, "graphs_used": line.used,
                          "calls_in_steps": in_steps, "calls_per_step": per_step,
                          "calls_outside_steps": line.outside},
                # (grad mode against torch.no_grad() for one forward, 1 thread of this 2-core CPU, median
                # of 300 calls: a DQN MLP 4-120-84-2 at batch 1: 11%, at batch 128: 5%; a
                # TransformerEncoderLayer(128) on 8 x 64: 3%; two convolutions at batch 32: 1%; a
                # 512-2048-512 MLP at batch 256: 0%)
                cost=Cost(ms_per_step=None, share_of_step=None, measured=False,
                          note="the host time grad mode adds to each op of the forward (0-11% of a CPU forward, "
                               "in the models measured) and the memory its graph keeps are counted, not timed"),
                fix=Fix(summary="Run this forward under `torch.no_grad()`: same results, no graph recorded.",
                        edits=[edit] if edit else []),
            )

