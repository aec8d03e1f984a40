"""nonfinite: the first step where the loss, a gradient or a weight stops being finite, and where
the first non-finite value was made. Also reads checkpoints (`audit checkpoint`)."""
from __future__ import annotations

import ast
import math
from typing import Any, Iterable, Iterator

import msgspec

from auditor.evidence import model as m
from auditor.evidence.checkpoint_summary import CheckpointSummary, TensorStats
from auditor.evidence.numerics import Origin, Range, Site, val
from auditor.evidence.numerics_view import NumericsView
from auditor.rules.base import Option, Options, Rule
from auditor.findings import Edit, Finding, Fix, Location
from auditor.rules._support.numerics_evidence import (NEEDS_NUMERICS, finite, location, needs_numerics, short,
                                                     site_location)
from auditor.rules._support.text import file_name
from auditor.fixes import parse_file, read_lines

FP32_EXP_LIMIT = 88.72  # exp(x) overflows float32 above this
FP16_MAX = 65504.0


def _names(params: list[str], shown: int = 4) -> str:
    """The first parameters' names, and how many more there are (all of them are in the evidence)."""
    more = f" and {len(params) - shown} more" if len(params) > shown else ""
    return ", ".join(f"`{p}`" for p in params[:shown]) + more


def _origin_head(ev: m.Evidence, view: NumericsView, step: int, what: list[str]) -> tuple[str, int | None]:
    """The message's first sentences: which value of which step became non-finite (and the step
    the checks did not see where it was first, when there was one: returned too)."""
    first = what[0] if what else "a value"
    followed = f" ({' and '.join(w + 's' for w in what[1:])} followed)" if len(what) > 1 else ""
    loss = next((v for i, v in view.loss_series() if i == step), None)
    head = f"Step {step} of {len(ev.steps)}: the {first} became {short(loss) if first == 'loss' and loss is not None else 'non-finite'}{followed}."
    # a step the checks did not see (timed or profiled: numerics.schedule) whose loss was read
    # non-finite at its end turned them on: the values went wrong there, this step shows where
    # they enter now
    unseen = next((e["step"] for _, d in view.steps for e in d.events
                   if e.get("event") == "unchecked-nonfinite-loss" and e.get("step", step) < step), None)
    if unseen is not None:
        head += (f" Its loss was first non-finite at step {unseen}, which the checks did not see (a timed or "
                 f"profiled step: see the docs on checked steps); step {step} is the first checked after it.")
    return head, unseen


def _made_by_a_call(view: NumericsView, step: int, o: Origin, head: str, kind: str, hazard: dict,
                    loc: Location | None, evidence: dict[str, Any]) -> tuple[str, str]:
    """(message, hazard kind) of a value a checked call made non-finite: in the forward pass, from
    the input, or in a hand-written backward (torch.autograd.Function); adds to `evidence`."""
    what = o.nonfinite or []
    site = view.site(o.site)
    mod = view.module_name(o.module)
    where_mod = ("" if not mod else f" in module `{mod[0]}` ({mod[1]})" if mod[0]
                 else f" in `{mod[1]}.forward`")
    ranges = ", ".join(f"[{short(r.min)}, {short(r.max)}]" for r in (o.inputs or [])[:3]
                       if r.min is not None)
    text = HAZARD_TEXT.get(kind, kind)
    series = view.hazard_series(o.site)
    msg = f"{head} It started{where_mod} at {_at(loc)}: {_call_text(site, loc)} {text}"
    if o.phase == "backward":  # (an op of a hand-written backward)
        params = o.params or []
        made = (f" made the gradients of {_names(params)} non-finite" if params
                else " went non-finite")
        lead = " The forward pass stayed finite; the backward pass" if "loss" not in what else " The backward pass"
        msg = (f"{head}{lead}{made}. It started in `{o.function}`, a hand-written backward (torch.autograd.Function), "
               f"at {_at(loc)}: {_call_text(site, loc)} {text}")
        evidence.update({"function": o.function, "params": params})
    if kind == "nonfinite-input":
        msg += (f" (parameter `{hazard['param']}` was already non-finite)" if hazard.get("param")
                else " (not made by any torch call in the step: the input data, a tensor kept from an earlier step, or a write through `.data`)")
    elif ranges:
        msg += f"; input ranges {ranges}"
    msg += "."
    # the site's series is of its own hazard (a pow's smallest input): not of a float16 overflow
    if series and site.hazard and not (kind == "fp16-overflow" and site.hazard != "fp16"):
        msg += f" {_series_text(site.hazard, series, step)}"
    norm = _finite_grads(view, step) if what == ["loss"] and kind == "fp16-overflow" else None
    if norm is not None:  # the loss's float16 value overflowed; what the backward made did not
        kind = "loss-overflow"
        msg += (f" Its gradients stayed finite (norm {short(norm)}): the loss's value overflowed "
                "float16; the gradients and the update did not.")
    if kind in ("overflow", "invalid", "fp16-overflow"):
        msg += _growth_text(view.loss_series(), step)
    evidence.update({"op": site.op, "module": mod[0] if mod else None,
                     "module_type": mod[1] if mod else None, "root": mod[2] if mod else None,
                     "inputs": msgspec.to_builtins(o.inputs), "outputs": msgspec.to_builtins(o.outputs),
                     "hazard_series": [x for x in series if x[0] <= step][-12:]})
    return msg, kind


def _made_by_the_backward(view: NumericsView, step: int, o: Origin, head: str, kind: str, loc: Location | None,
                          locs: list[Location], singular: list[tuple[int, float]], evidence: dict[str, Any]
                          ) -> tuple[str, str, Location | None, list[Location], Origin]:
    """(message, hazard kind, location, locations, origin) of gradients the backward pass made
    non-finite: at the singular calls (an infinite derivative: the fix is the first one's), else
    on the way back (how the numbers climbed before it); adds to `evidence`."""
    params = o.params or []
    # where the infinities came from (the singular calls), else where the backward pass started
    locs = [x for x in (site_location(view, s) for s, _ in singular) if x] or locs
    hint = "; ".join(_singular_text(view.site(s), v) for s, v in singular[:3])
    started = f" (the backward pass started at {_at(loc)}: `{loc.code}`)" if loc and not singular else ""
    msg = (f"{head} The forward pass stayed finite; the backward pass made the gradients of "
           f"{_names(params)} non-finite{started}" + "."
           + (f" The infinite derivative came from {hint}." if hint else ""))
    evidence["params"] = params
    evidence["singular_sites"] = [{"op": view.site(s).op, "hazard": view.site(s).hazard, "value": v}
                                  for s, v in singular]
    if not singular:  # an overflow on the way back: how the numbers climbed before it
        return msg + _growth_text(view.loss_series(), step), kind, loc, locs, o
    first_site = singular[0][0]  # the fix is the first singular call's: a log's input, a denominator
    kind = {"log": "log-of-zero", "div": "division-by-zero"}.get(view.site(first_site).hazard, kind)
    return msg, kind, site_location(view, first_site), locs, msgspec.structs.replace(o, site=first_site, inputs=[])


# --- source edits -------------------------------------------------------------------------------

def _segment(lines: list[str], node: ast.AST) -> str | None:
    if node.lineno != node.end_lineno:
        return None
    raw = lines[node.lineno - 1].encode()
    return raw[node.col_offset:node.end_col_offset].decode()


def _replace_node(file: str, line: int, lines: list[str], node: ast.AST, new: str) -> Edit | None:
    if node.lineno != line or node.end_lineno != line:
        return None
    raw = lines[line - 1].encode()
    text = (raw[:node.col_offset] + new.encode() + raw[node.end_col_offset:]).decode()
    return Edit(file=file, start=line, end=line, lines=[text])


def _method_on(seg: str, node: ast.AST, method: str) -> str:
    simple = isinstance(node, (ast.Name, ast.Attribute, ast.Call, ast.Subscript))
    return f"{seg}.{method}" if simple else f"({seg}).{method}"


def clamp_edit(file: str, line: int, kind: str, bound: str, span: list[int] | None = None) -> Edit | None:
    """Guard the operand of the hazard on `line`: the denominator of a division, the argument of a
    log or exp. `kind` is div | log | exp; `bound` the clamp call, e.g. "clamp_min(1e-12)".
    `span` (line, end line, column, end column of the call that made the NaN, when the run
    recorded it) picks that call among several on the line: `y * log(p) + (1 - y) * log(1 - p)`."""
    parsed = parse_file(file)
    if parsed is None:
        return None
    tree, lines = parsed
    candidates = list(_clamp_candidates(tree, lines, line, kind))
    if span:
        exact = [(n, t, seg) for n, t, seg in candidates
                 if [n.lineno, n.end_lineno, n.col_offset, n.end_col_offset] == list(span)]
        candidates = exact or candidates
    for _node, target, seg in candidates:
        return _replace_node(file, line, lines, target, _method_on(seg, target, bound))
    return None


def _clamp_candidates(tree: ast.AST, lines: list[str], line: int, kind: str) -> Iterator[tuple[ast.AST, ast.AST, str]]:
    """(the hazard's node, its operand to guard, the operand's source) for each hazard on `line`,
    in source order."""
    names = {"div": ("div", "true_divide", "divide"), "log": ("log", "log2", "log10"),
             "exp": ("exp", "exp2", "expm1")}[kind]
    nodes = sorted((n for n in ast.walk(tree) if getattr(n, "lineno", None) == line),
                   key=lambda n: (n.col_offset, -n.end_col_offset))
    for node in nodes:
        target = None
        if kind == "div" and isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            target = node.right
        elif isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            if name not in names:
                continue
            on_module = isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) \
                and node.func.value.id in ("torch", "F", "math")
            if isinstance(node.func, ast.Attribute) and not on_module:  # x.log() / a.div(b)
                target = node.args[0] if kind == "div" and node.args else node.func.value
            elif node.args:  # torch.log(x) / torch.div(a, b)
                target = node.args[1] if kind == "div" and len(node.args) > 1 else node.args[0]
        if target is None or isinstance(target, ast.Constant):
            continue
        seg = _segment(lines, target)
        if seg is None:
            continue
        yield node, target, seg


def _call_text(site: Site, loc: Location | None) -> str:
    """The op, with its source when the run recorded where on the line the call is: a line can
    hold two logs, and the reader must see which one hit 0."""
    op = site.op if site.op is not None else "a torch call"
    span = site.where.span if site.where is not None else None
    lines = read_lines(loc.file) if loc and span else None
    if not lines or span[0] != span[1] or not 0 < span[0] <= len(lines):
        return op
    seg = lines[span[0] - 1].encode()[span[2]:span[3]].decode(errors="replace")
    if not 0 < len(seg) <= 80:
        return op
    short = op.rsplit(".", 1)[-1]
    named = seg.startswith((op + "(", short + "(")) or f".{short}(" in seg  # the source says the op
    return f"`{seg}`" if named else f"{op} (`{seg}`)"


# --- the rule -----------------------------------------------------------------------------------

HAZARD_TEXT = {
    "division-by-zero": "divided by a value that reached 0",
    "log-of-zero": "took the log of a value that reached 0",
    "log-of-negative": "took the log of a negative value",
    "sqrt-of-negative": "took the square root of a negative value",
    "exp-overflow": "overflowed in exp (input too large)",
    "fp16-overflow": "overflowed float16 (values past 65504)",
    "overflow": "overflowed: finite inputs gave ±inf",
    "invalid": "made NaN from finite inputs (inf - inf, 0 * inf or 0 / 0 inside the call)",
    "nonfinite-input": "received an input that was already non-finite",
    "compiled": ("made non-finite values from finite inputs inside its compiled code, whose own calls are not "
                 "checked one by one"),
    "masked-row": ("made NaN from a mask: its only non-finite input is -inf where masked (an attention or "
                   "padding mask, by design), and a row masked entirely gives a softmax of all -inf, 0 / 0"),
}


def _masked_whole(o: Origin, hazard: dict) -> bool:
    """A call whose only non-finite input holds -inf and finite values (an additive mask, e.g. the
    one MultiheadAttention makes from a bool key_padding_mask) and whose output is NaN: a row
    masked entirely (an empty sequence), not bad input data. Repairing the inputs (nan_to_num)
    would break the masking."""
    ins, outs = o.inputs or [], o.outputs or []
    bad = [r for r in ins if not r.finite]
    return (not hazard.get("param") and len(bad) == 1 and bad[0].min == "-inf"
            and finite(bad[0].max) and any(r.min == "nan" or r.max == "nan" for r in outs))


class Nonfinite(Rule):
    """
    What it detects:
        The first step in which the loss, a gradient or a weight is NaN or infinite, and where that
        started: the first torch call (in execution order) whose inputs were finite and whose result
        was not, with the user's source line, the module (qualified name) it ran in, the input ranges
        that led there and the hazard (log of 0, division by 0, exp overflow, float16 past 65504).
        If the forward pass stayed finite it names the parameters whose gradients (backward) or
        values (optimizer update) went first, and for the backward pass the call whose derivative
        was infinite or overflowed float32 (a sqrt of 0, a log of 1e-42: 1/x = 1e42), with the fix
        for that call; a NaN made in the hand-written backward of a torch.autograd.Function of the
        user's is named at its line there. A call of code torch.compile compiled is one call: a NaN
        made inside it is named at the line that called it (`torch.compile(Net)` at `cnet(x)`).
        Checkpoints the step wrote with torch.save after the weights went
        non-finite are named as poisoned, with the last one written before (where to resume). Calls that made non-finite values in healthy steps
        (an attention mask's -inf) are not taken for the origin. Also reported: hazards that came
        close without tipping over (a log input below `near-zero`, exp near overflow, float16 values
        above `fp16-margin` of its range). On a checkpoint (`audit checkpoint`): every tensor holding
        NaN/inf, by name and count, model weights and optimizer state (exp_avg, exp_avg_sq) alike.
        A loss whose float16 value overflowed while the step's gradients stayed finite is named as
        that: the loss's overflow at its line (the update was made; the loss as read is inf), with
        the fix of computing it in float32 (and a GradScaler under float16 autocast without one).

    Why it costs:
        After the first NaN every later step is wasted: the weights are poisoned and the run only
        looks alive. The line that made it is usually far from where it is noticed.

    Example:
        bad:   x / x.norm(dim=-1, keepdim=True)          # a zero row gives 0/0
        good:  x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)   # or F.normalize(x, dim=-1)

    Fix:
        Guard the operand at the named line (clamp a denominator or a log input away from 0,
        subtract the max before exp, keep float16 values in range or use bfloat16); when values
        overflow after steady growth, see grad-explosion (clipping, a lower learning rate).
        Edits that add a clamp change results and stay out of fixes.patch unless asked for. For a
        NaN made inside compiled code, audit once with TORCHDYNAMO_DISABLE=1 to name the call.

    Evidence needed:
        A run with the numerics collector (the default), or a checkpoint file.
    """

    id = "nonfinite"
    title = "Loss, gradients or weights become NaN/inf"
    severity = "error"
    category = "numerics"
    needs = frozenset({"run", "checkpoint"})
    needs_text = NEEDS_NUMERICS
    options = (
        Option("near-zero", 1e-30, "A log input or |denominator| at or below this (but not 0) is a near miss."),
        Option("exp-margin", 2.0, "An exp input within this of overflow (88.7 in float32) is a near miss."),
        Option("fp16-margin", 0.5, "float16 values above this share of 65504 are a near miss.", high=1),
        Option("eps", 1e-12, "The clamp bound suggested for log inputs."),
        Option("den-eps", 1e-5, "The clamp bound suggested for denominators: a std or norm of constant data "
               "is rounding noise (~1e-7) over rounding noise, and 1e-12 would blow it up to 1e5 "
               "(BatchNorm and LayerNorm add 1e-5 to the variance)."),
    )

    def skip_reason(self, ev: m.Evidence) -> str | None:
        if ev.source == "checkpoint":
            return None if ev.checkpoint is not None else "the checkpoint evidence is missing"
        return needs_numerics(ev)

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        if ev.source == "checkpoint":
            yield from self._checkpoint(ev.checkpoint)
            return
        view = NumericsView.of(ev)
        named: set[int] = set()  # sites the error names: their near misses are part of it
        for i, d in view.steps:
            if d.origin is not None:
                o = d.origin
                singular = (singular_sites(view, o, options) if o.phase == "backward" and not o.function
                            else [])
                yield self._origin(ev, view, i, o, options, singular)
                named = {o.site} | {s for s, _ in singular}
                break
        yield from self._near_misses(view, options, named)

    # --- a run ----------------------------------------------------------------------------------

    def _origin(self, ev: m.Evidence, view: NumericsView, step: int, o: Origin, options: dict,
                singular: list[tuple[int, float]]) -> Finding:
        """The error for the origin `o` of the first non-finite step; `singular`: the calls whose
        derivative was infinite or overflowed there (singular_sites), for a backward-pass origin."""
        what = o.nonfinite or []
        head, unseen = _origin_head(ev, view, step, what)
        hazard = o.hazard or {}
        kind = hazard.get("kind", "unknown")
        if kind == "nonfinite-input" and _masked_whole(o, hazard):
            kind = "masked-row"
            hazard = {**hazard, "kind": kind}
        loc = site_location(view, o.site)
        locs = [loc] if loc else []
        evidence: dict[str, Any] = {
            "first_step": unseen if unseen is not None else step, "checked_step": step, "nonfinite": what, "phase": o.phase, "hazard": hazard,
            "steps_nonfinite": sum(1 for _, d in view.steps if d.loss_finite is False
                                   or any(r.grad_nonfinite or r.param_nonfinite for r in d.opt_steps)),
            "loss_series": [x for x in view.loss_series() if step - 10 <= x[0] <= step + 1],
            "grad_norm_series": [x for x in view.grad_norm_series() if x[0] <= step + 1][-12:],
            "ops_checked_in_step": o.ops_checked,
        }
        if o.phase in ("forward", "input") or (o.phase == "backward" and o.function):
            msg, kind = _made_by_a_call(view, step, o, head, kind, hazard, loc, evidence)
        elif o.phase == "backward":
            msg, kind, loc, locs, o = _made_by_the_backward(view, step, o, head, kind, loc, locs, singular, evidence)
        elif o.phase == "optimizer":
            params = o.params or []
            opt = view.optimizer_event(o.opt)
            locs = [x for x in [site_location(view, o.site), location(opt.get("where") if opt else None)] if x]
            msg = (f"{head} The gradients were finite; the {opt.get('type', 'optimizer') if opt else 'optimizer'} "
                   f"update made {_names(params)} non-finite (check its eps and lr).")
            evidence["params"] = params
        else:
            msg = f"{head} No checked torch call made it (it came from code the collector cannot see)."
        fix = self._fix(kind, loc, o.site, o.inputs or [], options, view)
        saved = _checkpoints(ev, view, step)
        if saved:
            msg += saved["text"]
            evidence["checkpoints"] = {k: v for k, v in saved.items() if k != "text"}
            if saved["clean"]:
                fix = msgspec.structs.replace(fix, summary=fix.summary + f" Resume from {saved['clean']['path']} "
                                                                         f"(saved in step {saved['clean']['step']}).")
        return self.finding(msg, locations=locs, evidence=evidence, fix=fix)

    def _fix(self, kind: str, loc: Location | None, site: int | None, inputs: list[Range], options: dict,
             view: NumericsView) -> Fix:
        """The fix for a hazard `kind` at the call of `site` whose inputs were `inputs`."""
        eps = options["eps"]
        where = view.site(site).where
        span = where.span if where is not None else None
        edit = None
        if kind == "division-by-zero":
            eps = options["den-eps"]
            den = inputs[1:2]
            nonneg = bool(den) and finite(den[0].min) and val(den[0].min) >= 0
            if loc and nonneg:
                edit = clamp_edit(loc.file, loc.line, "div", f"clamp_min({eps:g})", span)
            return Fix(summary=f"Keep the denominator away from 0: d.clamp_min({eps:g}), or F.normalize(x, dim=..., eps=...) for a norm.",
                       config={"denominator.clamp_min": eps}, edits=[edit] if edit else [], changes_numerics=True)
        if kind in ("log-of-zero", "log-of-negative"):
            if loc:
                edit = clamp_edit(loc.file, loc.line, "log", f"clamp_min({eps:g})", span)
            return Fix(summary=f"Keep the log's input above 0: log(p.clamp_min({eps:g})), or compute it in log space "
                               "(F.log_softmax, F.logsigmoid, F.binary_cross_entropy_with_logits).",
                       config={"log_input.clamp_min": eps}, edits=[edit] if edit else [], changes_numerics=True)
        if kind == "exp-overflow":
            if loc:
                edit = clamp_edit(loc.file, loc.line, "exp", "clamp_max(80.0)", span)
            return Fix(summary="Subtract the maximum before exp (torch.logsumexp, softmax), or clamp the input (x.clamp_max(80)).",
                       config={"exp_input.clamp_max": 80.0}, edits=[edit] if edit else [], changes_numerics=True)
        if kind == "loss-overflow":
            fp16 = any(e.get("dtype") == "float16" and e.get("enabled") for e in view.events_of("autocast"))
            scaler = bool(view.events_of("grad_scaler"))
            return Fix(summary="Compute the loss in float32: .float() on the prediction and the target before the "
                               "loss (under torch.autocast losses run in float32 already: leave them outside any "
                               ".half())"
                               + ("; with float16 autocast keep a torch.amp.GradScaler for the gradients "
                                  "(scaler.scale(loss).backward(), scaler.step(opt), scaler.update())"
                                  if fp16 and not scaler else "")
                               + ", or train in bfloat16, whose range is float32's. The step's update was made "
                                 "from finite gradients; the loss as read (a logged average, a NaN guard, an "
                                 "early stop) is inf.",
                       config={"loss.dtype": "float32"}, changes_numerics=True)
        if kind == "fp16-overflow":
            return Fix(summary="Keep values within float16's range (±65504): run this op in float32 "
                               "(autocast(enabled=False) and .float()), or autocast to bfloat16.",
                       config={"autocast.dtype": "bfloat16"}, changes_numerics=True)
        if kind == "masked-row":
            return Fix(summary="Keep at least one position unmasked in every row: drop empty sequences from the batch "
                               "(a length-0 sequence masks all its keys), or use a large finite negative value "
                               "(torch.finfo(dtype).min) instead of -inf and zero the fully masked rows' outputs.",
                       config={}, changes_numerics=True)
        if kind == "compiled":
            return Fix(summary="Find the call inside the compiled code: audit once with torch.compile off "
                               "(`TORCHDYNAMO_DISABLE=1 audit run ...`), which runs the same code eagerly, "
                               "every call of it checked.",
                       config={})
        if kind == "nonfinite-input":
            return Fix(summary="Reject or repair non-finite inputs before the step (torch.isfinite(x).all(), "
                               "torch.nan_to_num), and do not resume from weights that are already non-finite.",
                       config={})
        if kind == "backward":
            if view.site(site).hazard in ("sqrt", "pow", "norm"):
                return Fix(summary="A function whose derivative is infinite at 0 (sqrt, norm, pow < 1) saw 0: add an eps "
                                   "inside it (sqrt(x + eps), norm.clamp_min(eps)).", config={}, changes_numerics=True)
            lr = _first_lr(view)
            return Fix(summary="No checked call reached a point where its derivative is infinite (sqrt, norm or pow < 1 "
                               "at 0, a log input or denominator near 0), so a gradient overflowed on its way back: "
                               "clip gradients, lower the learning rate"
                               + (f" (it is {lr:.3g})" if lr else "")
                               + ", or find the call with torch.autograd.set_detect_anomaly(True) for one step.",
                       config={"lr": lr / 10} if lr else {}, changes_numerics=True)
        if kind == "update":
            return Fix(summary="The optimizer update itself overflowed: use a positive eps (Adam eps >= 1e-8) and a "
                               "lower learning rate.", config={"eps": 1e-8}, changes_numerics=True)
        lr = _first_lr(view)
        return Fix(summary="Values grew until they overflowed: lower the learning rate"
                           + (f" (it is {lr:.3g})" if lr else "")
                           + ", clip gradients (see grad-explosion), or normalise the inputs.",
                   config={"lr": lr / 10} if lr else {}, changes_numerics=True)

    def _near_misses(self, view: NumericsView, options: dict, skip: set) -> Iterable[Finding]:
        worst: dict[int, tuple[int, float]] = {}
        for i, d in view.steps:
            for s, v, *_ in d.hazards:
                x = val(v)
                kind = view.site(s).hazard
                if x is None or s in skip or not _near(kind, x, options):
                    continue
                prev = worst.get(s)
                if prev is None or _worse(kind, x, prev[1]):
                    worst[s] = (i, x)
        for s, (step, x) in sorted(worst.items()):
            site = view.site(s)
            kind = site.hazard
            loc = site_location(view, s)
            steps_near = sum(1 for i, d in view.steps for t, v, *_ in d.hazards
                             if t == s and val(v) is not None and _near(kind, val(v), options))
            yield self.finding(
                "Values come close to NaN/inf: guard this call's input. "
                f"The call {site.op} at {_at(loc)} came close to a non-finite value: {_HZ_STAT.get(kind, 'value')} "
                f"{short(x)} at step {step} ({steps_near} of {len(view.steps)} steps near the limit).",
                severity="warning", title="Values come close to NaN/inf",
                locations=[loc] if loc else [],
                evidence={"op": site.op, "hazard": kind, "worst": x, "worst_step": step,
                          "steps_near": steps_near, "series": view.hazard_series(s)[-30:]},
                fix=self._fix({"log": "log-of-zero", "div": "division-by-zero", "exp": "exp-overflow",
                               "fp16": "fp16-overflow"}.get(kind or "", "overflow"), loc,
                              None, [], options, view))

    # --- a checkpoint ---------------------------------------------------------------------------

    def _checkpoint(self, ck: CheckpointSummary) -> Iterable[Finding]:
        bad = [t for t in ck.tensors if t.bad]  # (a callback's +inf starting score is no fault)
        logged = ck.training_log.first_nonfinite if ck.training_log is not None else None
        history = _logged_history(logged) if logged else ""
        if not bad and not logged:
            return
        parts = ck.files or {}  # (a checkpoint directory: the files each part came from)
        training_log = msgspec.to_builtins(ck.training_log)
        if not bad:
            yield self.finding(
                "Training went NaN/inf before this save: use an earlier one. "
                f"Every tensor in {ck.file} is finite, but training had gone non-finite before it was saved."
                + history,
                severity="warning", evidence={"file": ck.file, "training_log": training_log,
                                              **({"files": parts["training_log"]} if parts.get("training_log") else {})},
                fix=Fix(summary="Resume from a checkpoint saved before that step, and find the origin with `audit run` "
                                "(lower the learning rate or clip gradients if grad_norm grew first).", config={}))
            return
        sections = sorted({t.section for t in bad})
        names = ", ".join(f"{t.name} ({_counts(t)})" for t in bad[:5])
        yield self.finding(
            "The checkpoint holds NaN/inf: resume from an earlier one. "
            f"{len(bad)} of {len(ck.tensors)} tensors in {ck.file} hold non-finite values "
            f"({', '.join(sections)}): {names}{' …' if len(bad) > 5 else ''}." + history,
            evidence={"file": ck.file, "tensors": msgspec.to_builtins(bad[:50]), "nonfinite_tensors": len(bad),
                      "nonfinite_values": sum(t.nonfinite for t in bad),
                      "sections": sections, "training_log": training_log,
                      **({"files": held} if (held := _files_holding(bad, ck)) else {})},
            fix=Fix(summary="Do not resume from this checkpoint: its weights or optimizer state are poisoned. "
                            "Resume from the last checkpoint without NaN/inf and find the origin with `audit run`.",
                    config={}))


def _files_holding(tensors: list[TensorStats], ck: CheckpointSummary) -> list[str]:
    """The files of a checkpoint directory that hold `tensors`: a weight's own shard when the index
    names it, else the files of its section (weights, optimizer.pt). Empty for a single file."""
    shards, parts = ck.shards or {}, ck.files or {}
    held: list[str] = []
    for t in tensors:
        held += [shards[t.name]] if t.name in shards else parts.get(t.section, [])
    return list(dict.fromkeys(held))


def _checkpoints(ev: m.Evidence, view: NumericsView, origin_step: int) -> dict[str, Any] | None:
    """The run's torch.save calls against the step its numbers went bad: files written after the
    weights were non-finite are poisoned ("loss=nan at epoch 29, and the checkpoint is poisoned"),
    one written in that step itself may be (before or after the update), and the last one written
    before it is where to resume."""
    saves = [(i, t.data.get("path"), t.where) for i, t in ev.tallies(m.SAVE)]
    if not saves:
        return None
    weights_bad = next((i for i, d in view.steps
                        if any(r.param_nonfinite for r in d.opt_steps)), origin_step)
    named = [(i, p) for i, p, _ in saves if p]
    poisoned = [{"step": i, "path": p} for i, p in named if i > weights_bad]
    maybe = [{"step": i, "path": p} for i, p in named if i == weights_bad]
    before = [(i, p) for i, p in named if i < origin_step]
    clean = {"step": before[-1][0], "path": before[-1][1]} if before else None
    if not poisoned and not maybe:
        return None
    text = ""
    if poisoned:
        text += (f" torch.save wrote {len(poisoned)} checkpoint(s) after the weights went non-finite (step "
                 f"{weights_bad}): {', '.join(file_name(c['path']) for c in poisoned[:4])}"
                 f"{' …' if len(poisoned) > 4 else ''}; do not resume from them.")
    if maybe:
        text += (f" {', '.join(file_name(c['path']) for c in maybe[:2])} was written in step {weights_bad} itself, "
                 "before or after its update: check it with `audit checkpoint`.")
    text += (f" The last checkpoint written before step {origin_step}: {file_name(clean['path'])} (step {clean['step']})."
             if clean else f" No checkpoint was written in this run before step {origin_step}.")
    return {"text": text, "weights_nonfinite_from_step": weights_bad, "poisoned": poisoned[:50],
            "maybe_poisoned": maybe, "clean": clean}


def _logged_history(logged: dict) -> str:
    """What a Hugging Face Trainer's trainer_state.json says about when the numbers went bad."""
    before = logged.get("last_finite") or {}
    lr = logged.get("learning_rate")
    parts = [f" The training log (trainer_state.json) has {logged['key']}={logged['value']} first at step "
             f"{logged.get('step')}"]
    if isinstance(lr, float):
        parts.append(f", learning rate {lr:.3g}")
    if isinstance(before.get("loss"), (int, float)):
        parts.append(f"; the last finite values were loss {before['loss']:.4g}")
    if isinstance(before.get("grad_norm"), (int, float)):
        parts.append(f", grad_norm {before['grad_norm']:.4g}")
    if before:
        parts.append(f" at step {before.get('step')}")
    return "".join(parts) + "."


FP32_MAX = 3.4028234663852886e38


def _derivative(kind: str | None, x: float) -> float | None:
    """How large the call's derivative gets at its hazard statistic `x` (the smallest log input or
    |denominator|, ...): infinite at 0 for all, 1/x for a log, 1/x**2 for a denominator (d(a/d)/dd
    = -a/d**2 with |a| ~ 1), 1/(2 sqrt x) for a sqrt. None for calls without such a point."""
    if kind not in ("log", "div", "sqrt", "pow", "norm") or not math.isfinite(x) or x < 0:
        return None
    if x == 0:
        return math.inf
    if kind == "log":
        return 1 / x
    if kind == "div":
        return 1 / x / x
    if kind == "sqrt":
        return 0.5 / math.sqrt(x)
    return None


def singular_sites(view: NumericsView, o: Origin, options: dict) -> list[tuple[int, float]]:
    """The calls of the origin's step that reached a point where their derivative is infinite or
    overflows float32 (a log input of 3e-44: 1/x = 3e43), or a near-zero log input or denominator:
    when only the backward pass went non-finite, these are where its infinities came from. Most
    singular first."""
    pairs = o.hazards
    if pairs is None:  # (an origin without its step's hazards: the backward hazard's own list)
        pairs = (o.hazard or {}).get("singular_sites") or []
    found = []
    for s, v in pairs:
        x, kind = val(v), view.site(s).hazard
        d = _derivative(kind, x) if x is not None else None
        if d is not None and (d >= FP32_MAX or (kind in ("log", "div") and x <= options["near-zero"])):
            found.append((s, x, d))
    found.sort(key=lambda t: -t[2])
    return [(s, x) for s, x, _ in found]


def _singular_text(site: Site, x: float) -> str:
    kind = site.hazard
    d = _derivative(kind, x)
    text = f"{site.op} at {_at(location(site.where))}, whose {_HZ_STAT.get(kind, 'value')} was {short(x)}"
    if x != 0 and d is not None and d >= FP32_MAX:
        text += f": its derivative {'1/x' if kind == 'log' else '1/x²' if kind == 'div' else '1/(2√x)'} = {d:.3g} overflows float32"
    return text


_HZ_STAT = {"log": "smallest input", "log1p": "smallest input", "sqrt": "smallest input", "pow": "smallest input",
            "div": "smallest |denominator|", "exp": "largest input", "norm": "smallest norm", "fp16": "largest |value|"}


def _near(kind: str | None, x: float, options: dict) -> bool:
    if kind in ("log", "div"):
        return 0.0 < abs(x) <= options["near-zero"]
    if kind == "exp":
        return math.isfinite(x) and FP32_EXP_LIMIT - options["exp-margin"] <= x <= FP32_EXP_LIMIT
    if kind == "fp16":
        return math.isfinite(x) and options["fp16-margin"] * FP16_MAX <= x <= FP16_MAX
    return False


def _worse(kind: str | None, a: float, b: float) -> bool:
    return a > b if kind in ("exp", "fp16") else abs(a) < abs(b)


def _series_text(kind: str, series: list[list], step: int) -> str:
    pts = [x for x in series if x[0] <= step]
    if len(pts) < 2:
        return ""
    # first, middle, last three: the middle one is before the last three (with 6 points, len // 2
    # is the first of them, and the text would show one step twice)
    show = pts if len(pts) <= 5 else [pts[0], pts[(len(pts) - 3) // 2], *pts[-3:]]
    return (f"Its {_HZ_STAT.get(kind, 'value')} per step went "
            + " → ".join(f"{short(v)} (step {i})" for i, v in show) + ".")


def _growth_text(losses: list[list], step: int) -> str:
    """' The loss had grown from A (step i) to B (step j).' when it grew over 100x."""
    pts = [(i, val(v)) for i, v in losses if i <= step and finite(v)]  # (a backward overflow's own loss is finite)
    if len(pts) < 2 or pts[0][1] <= 0 or pts[-1][1] / pts[0][1] < 100:
        return ""
    return (f" The loss had grown from {short(pts[0][1])} (step {pts[0][0]}) to {short(pts[-1][1])} "
            f"(step {pts[-1][0]}).")


def _finite_grads(view: NumericsView, step: int) -> float | None:
    """The global gradient norm of `step` when every optimizer step of it had finite gradients
    (None when one had not, or none was measured)."""
    recs = [r for i, r in view.opt_steps() if i == step]
    norms = [val(r.grad_norm) for r in recs]
    if not recs or any(r.grad_nonfinite for r in recs) or not all(n is not None and math.isfinite(n) for n in norms):
        return None
    return max(norms)


def _at(loc: Location | None) -> str:
    return f"{loc.file.rsplit('/', 1)[-1]}:{loc.line}" if loc else "an unknown line"


def _counts(t: TensorStats) -> str:
    parts = [f"{n} {label}" for n, label in ((t.nan, "NaN"), (t.posinf, "+inf"), (t.neginf, "-inf")) if n]
    return ", ".join(parts) + f" of {t.numel}"


def _first_lr(view: NumericsView) -> float | None:
    for _, r in view.opt_steps():
        lrs = r.lrs or []
        if lrs and finite(lrs[0]):
            return val(lrs[0])
    return None
