"""manual-update: parameters updated one at a time by hand-written code instead of an optimizer.

Two halves. The trace half reads a profiler trace recorded on a GPU with shapes (`audit analyze
TRACE`, and the profiler window of `audit run` on a CUDA machine, which records shapes and Python
stacks): in-place arithmetic on parameter-shaped tensors (`aten::add_` ... whose first input has
the shape of a weight or bias the trace's layers take, and whose second is a tensor of that same
shape: the gradient, or a buffer of it), called by the program outside every `Optimizer.step#...`
range and outside backward, each launching its own kernel. The rehearsal half judges a CUDA
rehearsal on the CPU, which tallies in-place updates of parameters that have a gradient
(`param-update`).
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Iterable

import msgspec
import numpy as np

from auditor.evidence import model as m
from auditor.evidence.trace.decode import CAT
from auditor.evidence.trace.efficiency import op_shapes
from auditor.evidence.trace.model import Trace
from auditor.evidence.trace.queries import frame_location_parts, sites
from auditor.findings import Cost, Finding, Fix, Location
from auditor.rules._support.gpu_costs import launch_cost
from auditor.rules._support.places import by_place, locations, steps_run
from auditor.rules._support.text import line_ref, per_step, sites_text
from auditor.rules._support.update_edits import foreach_update
from auditor.rules.base import Option, Options, Rule
from auditor.rules.suppression import unsuppressed


# In-place arithmetic an update loop is written with (`p.add_(g, alpha=-lr)`, `p -= lr * g`,
# `p.addcdiv_(m, v)`, `ema.lerp_(p, w)`).
UPDATE_OPS = ("aten::add_", "aten::sub_", "aten::mul_", "aten::div_", "aten::addcmul_", "aten::addcdiv_",
              "aten::lerp_")
# The operators that take parameters, and the positions of their weight and bias in `Input Dims`.
PARAM_ARGS = {
    "aten::linear": (1, 2), "aten::conv1d": (1, 2), "aten::conv2d": (1, 2), "aten::conv3d": (1, 2),
    "aten::convolution": (1, 2), "aten::_convolution": (1, 2), "aten::cudnn_convolution": (1,),
    "aten::miopen_convolution": (1, 2), "aten::native_batch_norm": (1, 2), "aten::cudnn_batch_norm": (1, 2),
    "aten::_batch_norm_impl_index": (1, 2), "aten::miopen_batch_norm": (1, 2), "aten::native_layer_norm": (2, 3),
    "aten::native_group_norm": (1, 2), "aten::_fused_rms_norm": (2,),
}
# Ranges whose in-place ops are not the program's own update loop: an optimizer's step (torch.optim
# names it `Optimizer.step#SGD.step`), and backward (gradient accumulation in `AccumulateGrad`).
NOT_A_LOOP = re.compile(r"^Optimizer\.|autograd::|AccumulateGrad|Backward")


class ManualUpdate(Rule):
    """
    What it detects:
        In-place updates of parameters that have a gradient, made by the program's own code in the
        step outside `Optimizer.step` -- a hand-written update loop such as
        `for p in model.parameters(): p.data.add_(p.grad, alpha=-lr)` or `p -= lr * p.grad` under
        `torch.no_grad()` -- on GPU tensors. Seen in CUDA rehearsal, at the line of the update.

        In a profiler trace recorded on a GPU with shapes: in-place `add_`/`sub_`/`mul_`/`div_`/
        `addcmul_`/`addcdiv_`/`lerp_` on a tensor of a parameter's shape (a weight or bias shape the
        trace's linear, convolution and norm layers take) with a second tensor of that shape, each
        launching a kernel, outside any `Optimizer.step#...` range and outside backward, covering at
        least `min-shape-share` of the parameter shapes in most steps; with the host's time in them
        (measured) and the user's function or line when the trace records Python stacks. An update
        of the weights' running average (an EMA loop) reads the same and costs the same.

    Why it costs:
        Each parameter and each arithmetic operation is its own kernel launch (a few microseconds of
        host time each, and more Python), where torch.optim's foreach implementation (the default
        on CUDA) updates all parameters in a handful of launches and `fused=True` in one. The cost
        is estimated for the device model's row (`--device`, else the default A100 SXM4 80GB): the
        updates per step less one launch per update line (what `torch._foreach_*` makes of each)
        x the row's launch latency (5 us NVIDIA, 7 us AMD); examples/gpu_manual_update.py's 6
        updates a step at one line: 5 x 5 us = 0.025 ms/step.

    Example:
        loss.backward()
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)        # one launch per parameter

    Fix:
        `opt = torch.optim.SGD(model.parameters(), lr=lr)` (or the optimizer the loop implements,
        with `foreach=True` or `fused=True`) and `opt.step()`; or `torch._foreach_add_(params, grads,
        alpha=-lr)` to keep the loop's arithmetic. The code patch does the latter where the loop is
        `for p in X.parameters():` around one `add_`/`sub_` of `p.grad` or `p -= A * p.grad`
        (rules/_support/update_edits.py says exactly which), as word_language_model's
        `p.data.add_(p.grad, alpha=-lr)`; other loops get the advice alone.

    Evidence needed:
        A profiler trace with CUDA activity and shapes (`record_shapes=True`): `audit run` on a CUDA
        machine (its profiler window records them), or `audit analyze TRACE`; or a CUDA rehearsal
        (`audit run` of CUDA code on a machine without a GPU, or `--rehearse`). A trace without
        shapes cannot tell a parameter's update from other in-place arithmetic: the rule stays silent.
    """

    id = "manual-update"
    reads = frozenset({"record_shapes"})  # (parameter-shaped in-place arithmetic)
    title = "Parameters updated one at a time outside an optimizer"
    severity = "warning"
    category = "performance"
    needs = frozenset({"run", "trace"})
    needs_text = ("needs a profiler trace with CUDA activity and shapes (`audit run` on a GPU, `audit analyze "
                  "TRACE`), or a CUDA rehearsal (`audit run --rehearse`)")
    options = (
        Option("min-share-of-steps", 0.5, "Report an update site only if it runs in at least this share of steps."),
        Option("min-updates-per-step", 4,
               "... and the sites together update at least this many parameters per step (fewer is no loop)."),
        Option("min-shape-share", 0.5,
               "Trace: ... and the updates cover at least this share of the parameter shapes the trace's layers "
               "take (a loop over the parameters touches them all; a running metric's counters do not)."),
    )

    @staticmethod
    def _cost(ev: m.Evidence, updates: float, lines: int) -> Cost:
        """The launches a foreach optimizer would not make, at the device model's launch latency:
        the loop's updates per step less one launch per update line (`torch._foreach_*` makes
        about one of each operation, for up to ~100s of parameters). These launches are also in
        launch-bound's count when it fires on the run: the headline's sum counts them once."""
        cost = launch_cost(ev, max(0.0, updates - lines), "per-parameter launches",
                           f"{updates:g} parameter updates/step at {lines} line(s), less the {lines} launch(es) "
                           "torch._foreach_* would make of them (about one per operation for up to ~100s of "
                           "parameters)")
        return msgspec.structs.replace(cost, within="launch-bound")

    def skip_reason(self, ev: m.Evidence) -> str | None:
        """A run without a trace is judged in CUDA rehearsal only: elsewhere its updates are not recorded."""
        return None if ev.trace_data or ev.environment.rehearsal else self.needs_text

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        yield from self.trace_findings(ev, options)
        if ev.environment.rehearsal:
            yield from self.rehearsal_findings(ev, options)

    def check_trace(self, trace: Trace, options: Options, launched_only: bool = True) -> Finding | None:
        """One finding when the trace's parameter-shaped in-place updates outside an optimizer form a
        loop over the parameters in most steps. `launched_only=False` also counts updates that
        launched no kernel (a trace recorded on the CPU), for tests of the rest of the judgement."""
        rows, shapes = manual_updates(trace, launched_only)
        if not len(rows) or not shapes:
            return None
        steps = trace.step_count()
        step_col = trace.col("step")[rows]
        update_steps = set(step_col.tolist())
        if len(update_steps) < options.min_share_of_steps * steps or len(rows) / steps < options.min_updates_per_step:
            return None
        dims = op_shapes(trace)
        updated = {tuple(dims[int(r)][0][0]) for r in rows}
        if len(updated) < options.min_shape_share * len(shapes):
            return None
        host_ms = float(trace.col("dur")[rows].sum()) / 1000.0
        ops = Counter(trace.name(int(r)) for r in rows)
        where = sites(trace, rows)
        at = sites_text(where, steps)
        locs = [Location(*frame_location_parts(f)) for f, _, _ in where]
        return self.finding(
            "Parameters are updated one by one: use torch.optim. "
            f"{per_step(len(rows) / steps)} in-place updates of parameter-shaped tensors per step outside an "
            f"optimizer in {trace.label} ({', '.join(f'{k} x{per_step(v / steps)}' for k, v in ops.most_common())}), "
            f"covering {len(updated)} of the {len(shapes)} parameter shapes the layers take, one kernel launch each: "
            f"{host_ms / steps:.2f} ms per step of host time in them{at}; a foreach or fused torch.optim optimizer "
            "updates all parameters in a few launches.",
            locations=locs,
            evidence={"trace": str(trace.path), "updates": int(len(rows)),
                      "updates_per_step": round(len(rows) / steps, 2), "steps": steps,
                      "steps_with_updates": len(update_steps), "shapes_updated": len(updated),
                      "parameter_shapes": len(shapes), "host_ms_per_step": round(host_ms / steps, 3),
                      "ops": dict(ops.most_common()),
                      "sites": [{"file": f.file, "line": f.line, "count": n} for f, n, _ in where]},
            cost=Cost(ms_per_step=round(host_ms / steps, 3), share_of_step=None,  # (trace_findings sets it)
                      measured=True, note="the host's time in the per-parameter update calls; a foreach or fused "
                                          "update makes the same arithmetic in a few launches"),
            fix=_FIX,
        )

    def rehearsal_findings(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        """One finding for a CUDA rehearsal whose parameter updates outside an optimizer form a loop."""
        if not ev.steps:
            return
        n = steps_run(ev)
        places = [p for p in by_place(ev.tallies(m.PARAM_UPDATE)) if len(p.steps) >= options.min_share_of_steps * n]
        places = unsuppressed(self.id, places, lambda p: p.where)
        count = sum(p.count for p in places)
        if not places or count / n < options.min_updates_per_step:
            return
        first = places[0].where.file if places[0].where else None
        yield self.finding(
            "Parameters are updated one by one: use torch.optim. "
            f"On the GPU each of these is a kernel launch per parameter: {per_step(count / n)} in-place parameter "
            "updates per step outside an optimizer, at "
            + "; ".join(f"{p.what} x{per_step(p.count / n)}/step at "
                        f"{line_ref(p.where.file if p.where else None, p.where.line if p.where else None, first)}"
                        for p in places[:5])
            + "; a foreach or fused torch.optim optimizer updates all parameters in a few launches.",
            locations=(locs := locations(places)),
            evidence={"updates_per_step": round(count / n, 2), "steps": n,
                      "sites": [{"what": p.what, "file": p.where.file if p.where else None,
                                 "line": p.where.line if p.where else None, "count": p.count,
                                 "steps": len(p.steps)} for p in places]},
            cost=self._cost(ev, count / n, len(places)),
            fix=_fix(locs),
        )


_FIX = Fix(summary="Replace the loop with a torch.optim optimizer (e.g. torch.optim.SGD(model.parameters(), "
                   "lr=lr, foreach=True), or fused=True) and call opt.step(); or keep the arithmetic with "
                   "torch._foreach_add_(params, grads, alpha=-lr).",
           config={"optimizer": {"foreach": True}})


def _fix(locs: list[Location]) -> Fix:
    """The advice, with a code patch for each update loop that one foreach call computes as it does
    (auditor.rules._support.update_edits)."""
    edits = [e for loc in locs if loc.file and loc.line and (e := foreach_update(loc.file, loc.line))]
    if not edits:
        return _FIX
    return msgspec.structs.replace(_FIX, edits=edits, summary=_FIX.summary + " The code patch makes each loop one "
                                   "torch._foreach_* call that does the loop's arithmetic in a few launches.")


def parameter_shapes(trace: Trace) -> set[tuple[int, ...]]:
    """The weight and bias shapes the trace's layers take (PARAM_ARGS, from `Input Dims`)."""
    out: set[tuple[int, ...]] = set()
    shapes = op_shapes(trace)
    if not shapes:
        return out
    names, args = trace.col("name"), trace.col("args")
    rows = np.fromiter(shapes, dtype=np.int64, count=len(shapes))
    # a row's dims are its argument record's: each distinct (operator name, record) is read once
    pair = names[rows].astype(np.int64) * (int(args.max()) + 1) + args[rows]
    _, first = np.unique(pair, return_index=True)
    for r in rows[first].tolist():
        dims = shapes[r][0]
        for i in PARAM_ARGS.get(trace.symbols[int(names[r])], ()):
            d = dims[i] if i < len(dims) else None
            if isinstance(d, list) and d and all(isinstance(x, int) for x in d):
                out.add(tuple(d))
    return out


def manual_updates(trace: Trace, launched_only: bool = True) -> tuple[np.ndarray, set[tuple[int, ...]]]:
    """(rows of the program's in-place updates of parameter-shaped tensors, the parameter shapes).

    An update: an UPDATE_OPS operator called by the program itself (no operator encloses it), not
    inside an optimizer's step or backward (NOT_A_LOOP), not the auditor's own, whose first input
    has a parameter's shape and whose second is a tensor of the same shape; with `launched_only`,
    it launched a kernel (a launch call in it that the trace links to GPU work)."""
    shapes = parameter_shapes(trace)
    empty = np.empty(0, dtype=np.int64)
    if not shapes:
        return empty, shapes
    dims = op_shapes(trace)
    cat, parent, names, link = trace.col("cat"), trace.col("parent"), trace.col("name"), trace.col("link")
    codes = {trace.symbols.id(n) for n in UPDATE_OPS} - {-1}
    rows = [r for r in dims if int(names[r]) in codes]
    launched: set[int] = set()
    if launched_only:
        calls = np.flatnonzero(np.isin(cat, (CAT["runtime"], CAT["driver"])) & (link >= 0))
        launched = set(parent[calls].tolist())
    mine = trace.auditor_rows() if len(trace.auditor_ranges()) else None
    out = []
    for r in rows:
        d = dims[r][0]
        if len(d) < 2 or not isinstance(d[0], list) or tuple(d[0]) not in shapes or d[1] != d[0]:
            continue
        if (launched_only and r not in launched) or (mine is not None and mine[r]):
            continue
        chain = trace.ancestors(r)
        if any(cat[a] == CAT["cpu_op"] and trace.symbols[int(names[a])].startswith("aten::") for a in chain):
            continue
        if any(NOT_A_LOOP.search(trace.symbols[int(names[a])]) for a in chain if cat[a] != CAT["python"]):
            continue
        out.append(r)
    return np.array(sorted(out), dtype=np.int64), shapes
