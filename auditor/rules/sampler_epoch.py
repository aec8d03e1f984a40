"""sampler-epoch: a shuffling DistributedSampler iterated again without set_epoch repeats its order."""
from __future__ import annotations

import ast
from typing import Iterable

from auditor.evidence import model as m
from auditor.rules.base import Options, Rule
from auditor.findings import Finding, Fix, Location
from auditor.rules._support.text import file_name
from auditor.fixes import call_name, insert_before_header, parse_file, read_lines


class SamplerEpoch(Rule):
    """
    What it detects:
        A `DistributedSampler(shuffle=True)` whose iterations (the epochs of its DataLoader) all
        start with the same epoch value: `sampler.set_epoch(epoch)` is never called, or called
        with a constant. (An epoch value that changes is set_epoch at work: a loader iterated
        twice in one epoch repeats that epoch's order on purpose, and is not flagged.) Reports how many epochs repeated an earlier one's
        order, where the sampler was made, and the line that started those epochs.

    Why it costs:
        A DistributedSampler shuffles with the seed `seed + epoch`, and its epoch only changes
        through `set_epoch`. Without it every epoch visits the samples in the same order on every
        rank, and each rank sees the same shard of the data each epoch: the shuffle the code asks
        for never happens, which usually costs accuracy and nothing says so.

    Example:
        bad:   for epoch in range(epochs):
                   for x, y in loader:                    # loader = DataLoader(ds, sampler=sampler)
        good:  for epoch in range(epochs):
                   sampler.set_epoch(epoch)
                   for x, y in loader:

    Fix:
        Call `sampler.set_epoch(epoch)` before each epoch's loop, with the epoch number. The patch
        (marked as changing results: the data order changes) inserts it before the line that started
        the repeated epochs, when the sampler's name is
        the `sampler=` argument of a DataLoader in the file and an epoch counter is in reach (the
        loop variable of an enclosing `for ... in range(...)`, or a variable named `epoch`).

    Evidence needed:
        A run that covers at least two epochs of the sampler: a probe on
        `DistributedSampler.__iter__` (it runs once per epoch) records the epoch each iteration
        starts with. A sampler iterated once, or with shuffle=False, is not judged; an iteration
        left before the end of its indices (`next(iter(loader))` to look at one batch) is no epoch.
    """

    id = "sampler-epoch"
    title = "DistributedSampler repeats the same shuffle every epoch (no set_epoch)"
    severity = "warning"
    category = "correctness"
    needs = frozenset({"run"})

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        samplers: dict[int, list[m.Tally]] = {}
        for _, t in ev.tallies(m.SAMPLER_ITER, include_setup=True):
            samplers.setdefault(t.data.get("sampler", 0), []).extend([t] * max(t.count, 1))
        for iterations in samplers.values():
            if not iterations[0].data.get("shuffle"):
                continue
            # an iteration the next one says was left before its end (a peek at the first batch)
            # is no epoch; the last one, still running, is
            starts = [t for t, nxt in zip(iterations, iterations[1:] + [None])
                      if nxt is None or nxt.data.get("prev_finished") is not False]
            epochs = [t.data.get("epoch") for t in starts]
            # an epoch that changed is set_epoch at work: a loader iterated twice per epoch (an
            # evaluation pass over the training loader) repeats an order on purpose
            if len(starts) > 1 and len(set(map(str, epochs))) == 1:
                yield self._finding(starts, epochs, starts[1:], len(iterations) - len(starts))

    def _finding(self, starts: list[m.Tally], epochs: list, repeats: list[m.Tally], left_early: int) -> Finding:
        d = starts[0].data
        made_file, made_line = d.get("made_file"), d.get("made_line")
        kind = starts[0].what.removesuffix(".__iter__")
        made = f"made at {file_name(made_file)}:{made_line}" if made_file and made_line else "(made outside the user's code)"
        at = repeats[0].where
        started = f"{file_name(at.file)}:{at.line}" if at else "an unknown line"
        how = f"its epoch stayed {epochs[0]} (set_epoch never called, or called with a constant)"
        locs = []
        if made_file and made_line:
            locs.append(Location(file=made_file, line=made_line, code=_code(made_file, made_line)))
        for t in repeats:
            if t.where and (t.where.file, t.where.line) not in {(loc.file, loc.line) for loc in locs}:
                locs.append(Location.of(t.where))
        edits = []
        if at is not None and made_file and made_line:
            name = sampler_name(made_file, made_line)
            counter = epoch_counter(at.file, at.line) if name else None
            if name and counter and (e := insert_before_header(at.file, at.line, f"{name}.set_epoch({counter})")):
                edits.append(e)
        return self.finding(
            "Each epoch repeats the same shuffle: call sampler.set_epoch(epoch). "
            f"The shuffling {kind} {made} started {len(starts)} epochs and {len(repeats)} of them repeated "
            f"the order of an earlier one: it shuffles with seed + epoch, and {how}. Every epoch from "
            f"{started} visits its samples in the same order, on every rank.",
            locations=locs,
            evidence={"sampler": kind, "epochs_started": len(starts), "epochs_repeated": len(repeats),
                      "iterations_left_early": left_early,
                      "epoch_values": epochs, "made": {"file": made_file, "line": made_line},
                      "started_at": {"file": at.file, "line": at.line} if at else None},
            cost=None,
            fix=Fix(summary="Call sampler.set_epoch(epoch) before each epoch's loop over the DataLoader, with the "
                            "epoch number, so that each epoch shuffles differently.", edits=edits,
                    changes_numerics=True),  # (a new data order: it changes results)
        )


def _code(file: str, line: int) -> str:
    lines = read_lines(file)
    return lines[line - 1].strip() if lines and 0 < line <= len(lines) else ""


def sampler_name(file: str, line: int) -> str | None:
    """The variable the sampler made on `line` is assigned to (`sampler = DistributedSampler(...)`),
    when a DataLoader call in the file takes that name as its `sampler=` argument."""
    parsed = parse_file(file)
    if parsed is None:
        return None
    tree, _ = parsed
    name = None
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and node.lineno == line and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Call)):
            name = node.targets[0].id
    if name is None:
        return None
    for node in ast.walk(tree):
        if (call_name(node) or "").endswith("DataLoader") and any(
                kw.arg == "sampler" and isinstance(kw.value, ast.Name) and kw.value.id == name
                for kw in node.keywords):
            return name
    return None


def epoch_counter(file: str, line: int) -> str | None:
    """The epoch number in reach at `line`: the target of the innermost `for NAME in range(...)`
    around it, else a variable (or a function's parameter) named `epoch` the file has."""
    parsed = parse_file(file)
    if parsed is None:
        return None
    tree, _ = parsed
    best = None
    for node in ast.walk(tree):
        if (isinstance(node, ast.For) and node.lineno < line <= (node.end_lineno or node.lineno)
                and isinstance(node.target, ast.Name) and call_name(node.iter) == "range"
                and (best is None or node.lineno > best.lineno)):
            best = node
    if best is not None:
        return best.target.id
    # `epoch` bound in the function around the line (a parameter, an assignment) or at module level
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]

    def owner(lineno: int) -> ast.AST | None:  # the innermost function holding a line
        return max((f for f in funcs if f.lineno <= lineno <= (f.end_lineno or f.lineno)),
                   key=lambda f: f.lineno, default=None)

    around = owner(line)
    for node in ast.walk(tree):
        bound = ((isinstance(node, ast.Name) and node.id == "epoch" and isinstance(node.ctx, ast.Store))
                 or (isinstance(node, ast.arg) and node.arg == "epoch"))
        if bound and owner(node.lineno) in (None, around):
            return "epoch"
    return None
