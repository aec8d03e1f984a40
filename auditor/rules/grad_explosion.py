"""grad-explosion: the global gradient norm spikes by orders of magnitude or grows steadily."""
from __future__ import annotations

import ast
import math
from statistics import median
from typing import Iterable

from auditor.evidence import model as m
from auditor.rules.base import Option, Options, Rule
from auditor.findings import Edit, Finding, Fix
from auditor.rules._support.trends import quarter_medians, spearman
from auditor.fixes import parse_file
from auditor.evidence.numerics import OptStep, val
from auditor.evidence.numerics_view import NumericsView
from auditor.rules._support.numerics_evidence import NEEDS_NUMERICS, finite, needs_numerics, short, site_location


class GradExplosion(Rule):
    """
    What it detects:
        The global gradient norm (all parameters of an optimizer, measured just before each
        `optimizer.step()`, after any clipping) jumping to `spike-ratio` times the median of the
        preceding steps, or rising steadily: a rank correlation of log-norm with the step of at
        least `min-correlation` and a last-quarter median `growth-ratio` times the first quarter's;
        or norms that rose at every step seen (three or more, `growth-ratio` times in all) until
        the norm turned non-finite. It names the step, the norm series and the layers
        whose gradients dominate the norm.
        Not an explosion: a norm at the program's own `clip_grad_norm_` max_norm (the clip bounded
        that update), and a jump at a step whose loss jumped with it while the losses after it do
        not climb further (the program changed its data or task there: a curriculum's next stage),
        also when that loss overflowed to inf while the gradients stayed finite (nonfinite reports
        the loss's overflow at its line).

    Why it costs:
        One exploding step throws the weights far from where training had brought them; steady
        growth ends in overflow and NaN a few steps later (see nonfinite). Either way the steps
        after it are wasted.

    Example:
        bad:   loss.backward(); opt.step()                 # lr too high, no clipping
        good:  loss.backward()
               torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
               opt.step()

    Fix:
        Clip the gradient norm, with `max_norm` taken from the observed norms (the
        `clip-percentile` of the healthy steps; none is suggested from fewer than `min-healthy`
        of them, as in a run that grows from its first steps); lower the learning rate; make a
        warm-up stop rising. The clipping edit changes results and stays out of fixes.patch
        unless asked for.

    Evidence needed:
        A run with the numerics collector (gradient norms per optimizer step, the loss per step,
        the max_norm of any clip_grad_norm_ of an optimizer's parameters).
    """

    id = "grad-explosion"
    title = "Gradient norm explodes"
    severity = "warning"
    category = "numerics"
    needs = frozenset({"run"})
    needs_text = NEEDS_NUMERICS
    options = (
        Option("spike-ratio", 10.0, "A norm this many times the median of the preceding steps is a spike."),
        Option("window", 5, "Preceding optimizer steps whose median a spike is measured against.", low=1),
        Option("min-history", 3, "Optimizer steps needed before a spike can be judged."),
        Option("growth-ratio", 10.0, "Last-quarter over first-quarter median norm that counts as growth."),
        Option("min-correlation", 0.8, "Rank correlation of log-norm with step needed for steady growth."),
        Option("min-steps", 8, "Optimizer steps needed to judge steady growth."),
        Option("clip-percentile", 90, "Percentile of the healthy steps' norms suggested as max_norm.", high=100),
        Option("min-healthy", 3, "Healthy steps needed to derive max_norm from their norms; with fewer (a run "
                                 "that grows from its first steps) none is suggested.", low=1),
        Option("healthy-factor", 3.0, "Norms up to this many times the typical norm before the explosion "
                                      "(the median before a spike, the first step's before steady growth) "
                                      "count as healthy."),
    )

    def skip_reason(self, ev: m.Evidence) -> str | None:
        return needs_numerics(ev)

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        view = NumericsView.of(ev)
        by_opt: dict[int, list[tuple[int, OptStep]]] = {}
        for step, r in view.opt_steps():
            if r.grad_norm is not None:
                by_opt.setdefault(r.opt, []).append((step, r))
        for opt, recs in sorted(by_opt.items()):
            f = self._one(view, opt, recs, options)
            if f is not None:
                yield f

    def _one(self, view: NumericsView, opt: int, recs: list[tuple[int, OptStep]], options: dict) -> Finding | None:
        series = [(s, val(r.grad_norm)) for s, r in recs]
        healthy_end = next((k for k, (_, v) in enumerate(series) if v is None or not math.isfinite(v)), len(series))
        fin = series[:healthy_end]  # the norms before any non-finite one
        went_nonfinite = healthy_end < len(series)
        limit = _clip_limit(view, opt)
        growth = _growth(fin, options, limit)  # a steady climb first: in it every step looks like a spike
        spike = _spike(fin, options, limit)
        if spike is not None and _loss_jumped(view.loss_series(), spike["step"], options):
            spike = None  # the program's data or task changed (a curriculum's next stage): not an explosion
        rise = _rise(fin, options) if went_nonfinite else None
        # ...unless one step's jump makes most of the climb (2.5 -> 1e10 at step 18, then level): a
        # rank correlation that high comes from the jump, and "grew steadily" would mislead
        if growth is not None and (spike is None or math.log(spike["ratio"]) < 0.5 * math.log(growth["ratio"])):
            spike = None
        elif growth is not None:
            growth = None
        # Norms that grew at every step seen until the values turned non-finite: that climb, not a
        # jump within it, is what went wrong (too large a learning rate)
        if growth is None and rise is not None and (spike is None or spike["index"] >= rise["from_index"]):
            growth, spike = rise, None
        if spike is None and growth is None:
            return None
        k = spike["index"] if spike else len(fin) - 1
        step, rec = recs[k]
        # Healthy: before the spike, and not far above the norms typical before it: their median
        # (the first step's alone can be 100x below the rest, and a max_norm from it would all but
        # stop training). A steady climb grows from its first step: that is where it was healthy.
        before = [v for _, v in fin[:spike["index"] if spike else len(fin)]]
        typical = median(before) if spike else before[0]
        healthy = [v for v in before if v <= options["healthy-factor"] * typical] or before[:1]
        # A percentile of one or two norms is those norms: with fewer than min-healthy healthy steps
        # (a run that diverges from its second step) no max_norm is derived, as nothing in the run
        # supports one.
        enough = len(healthy) >= options["min-healthy"]
        max_norm = _round2(_percentile(healthy, options["clip-percentile"])) if enough else None
        if spike:
            what = (f"The gradient norm jumped to {short(spike['norm'])} at step {step}, "
                    f"{_times(spike['ratio'])}x the median {short(spike['reference'])} of the {spike['window']} steps before")
        elif growth.get("rising"):
            what = (f"The gradient norm grew at every step seen, from {short(growth['first'])} at step "
                    f"{growth['from_step']} to {short(growth['last'])} at step {growth['to_step']} "
                    f"(x{_times(growth['ratio'])} over {growth['steps']} steps measured)")
        else:
            what = (f"The gradient norm grew steadily from {short(growth['first'])} to {short(growth['last'])} "
                    f"(x{growth['ratio']:.3g}, about x{growth['per_step']:.3g} per step, rank correlation "
                    f"{growth['spearman']:.2f}) over {len(fin)} optimizer steps")
        if went_nonfinite:
            what += f", then turned non-finite at step {series[healthy_end][0]}"
        layers = rec.top_layers or []
        dom = ", ".join(f"`{name}` ({share:.0%})" for name, _, share in layers[:3] if share is not None)
        msg = (("The gradient norm spiked: clip it or lower the learning rate. " if spike else
                "The gradient norm keeps growing: lower the learning rate. ")
               + what + (f"; {dom} of it." if dom else "."))
        loc = site_location(view, rec.site)
        lr = val((rec.lrs or [None])[0])
        edit = clip_edit(loc.file, loc.line, max_norm) if loc and max_norm else None
        opt_event = view.optimizer_event(opt)
        return self.finding(
            msg, locations=[loc] if loc else [],
            evidence={"optimizer": opt_event.get("type") if opt_event else None, "step": step,
                      "series": [[s, r.grad_norm] for s, r in recs][:200],
                      "spike": spike, "growth": growth, "went_nonfinite": went_nonfinite,
                      "top_layers": layers, "top_params": rec.top_params,
                      "healthy_steps": len(healthy), "suggested_max_norm": max_norm, "lr": lr},
            fix=Fix(summary=(f"Clip gradients: torch.nn.utils.clip_grad_norm_(params, max_norm={max_norm:g}) "
                             f"(the {options['clip-percentile']}th percentile of {len(healthy)} healthy steps' norms) "
                             "before optimizer.step(); lower the learning rate" + (f" (now {lr:g})" if lr else "")
                             if max_norm else
                             "Lower the learning rate" + (f" (now {lr:g})" if lr else "")
                             + (f": the run had {len(healthy)} healthy step{'' if len(healthy) == 1 else 's'} before "
                                + (f"the spike at step {step}" if spike else "its norm grew")
                                + f", too few to derive a clipping max_norm from ({options['min-healthy']} are "
                                "needed); once it is stable, clip at the norm it shows"
                                if not enough else "; clip gradients before optimizer.step()"))
                            + "; make any warm-up stop rising.",
                    config={k: v for k, v in (("clip_grad_norm_.max_norm", max_norm),
                                              ("lr", _round2(lr / 10) if lr else None)) if v is not None},
                    edits=[edit] if edit else [], changes_numerics=True))


def _times(ratio: float) -> str:
    """50 -> "50", 4340633247 -> "4.34e+09": a ratio with no more digits than it means."""
    return f"{ratio:.0f}" if ratio < 1e4 else f"{ratio:.3g}"


def _clip_limit(view: NumericsView, opt: int) -> float | None:
    """The max_norm the program clips this optimizer's gradients to with `clip_grad_norm_` (2-norm),
    the smallest where it clips at several; None where it does not clip them."""
    limits = [val(e.get("limit")) for e in view.events_of("clip")
              if e.get("opt") == opt and val(e.get("norm_type", 2.0)) in (2, 2.0)]
    limits = [v for v in limits if isinstance(v, (int, float)) and finite(v) and v > 0]
    return min(limits) if limits else None


def _clipped(v: float, limit: float | None) -> bool:
    """A norm at the program's max_norm (to float32 rounding): clip_grad_norm_ scaled it there, and
    the norm before the clip was larger by an unknown factor, bounded by the clip."""
    return limit is not None and v >= limit * (1 - 1e-3)


def _loss_jumped(losses: list[list], step: int, options: dict) -> bool:
    """The loss of `step` (computed before its update, so not the update's doing) jumped by
    `spike-ratio` over the median of the steps before, and the steps after it do not climb above
    it: the program changed its data or task there (a curriculum's next stage), and the gradient
    norm jumped with the loss it was of. A loss that keeps climbing after the jump is a model
    thrown off by that step's update: still an explosion."""
    by_step = {s: val(v) for s, v in losses}
    before = [v for s, v in sorted(by_step.items()) if s < step and finite(v)][-options["window"]:]
    at = by_step.get(step)
    after = [v for s, v in sorted(by_step.items()) if step < s <= step + options["window"]]
    if not before or at is None or math.isnan(at) or not after or median(before) <= 0:
        return False
    # an infinite loss over finite gradients (the norm is measured finite) overflowed its own
    # dtype, float16's 65504 most often: a jump of the loss, reported by nonfinite at its line
    return at / median(before) >= options["spike-ratio"] and all(finite(v) and v <= 2 * at for v in after)


def _rise(fin: list[tuple[int, float]], options: dict) -> dict | None:
    """The norms that rose at every step seen up to a non-finite value: the last run of three or
    more, each above the one before, `growth-ratio` times from its first to its last."""
    k = len(fin) - 1
    while k > 0 and fin[k][1] > fin[k - 1][1] > 0:
        k -= 1
    run = fin[k:]
    if len(run) < 3 or run[-1][1] / run[0][1] < options["growth-ratio"]:
        return None
    ratio = run[-1][1] / run[0][1]
    return {"rising": True, "first": run[0][1], "last": run[-1][1], "from_step": run[0][0], "to_step": run[-1][0],
            "from_index": k, "steps": len(run), "ratio": round(ratio, 3),
            "per_step": round(ratio ** (1 / (run[-1][0] - run[0][0])), 3)}


def _spike(fin: list[tuple[int, float]], options: dict, limit: float | None = None) -> dict | None:
    """The first norm `spike-ratio` times the median of the steps just before it that is also
    above every norm seen before: a norm climbing back to where it has already been (momentum
    makes norms swing by 100x over tens of steps) is not an explosion. A norm at the program's
    own clip (`limit`) is not one either: the clip bounded that step's update."""
    for k in range(options["min-history"], len(fin)):
        window = [v for _, v in fin[max(0, k - options["window"]):k]]
        ref = median(window)
        v = fin[k][1]
        if _clipped(v, limit):
            continue
        if ref > 0 and v / ref >= options["spike-ratio"] and v > max(u for _, u in fin[:k]):
            return {"index": k, "step": fin[k][0], "norm": v, "reference": ref, "ratio": round(v / ref, 2),
                    "window": len(window)}
    return None


def _growth(fin: list[tuple[int, float]], options: dict, limit: float | None = None) -> dict | None:
    """A steady climb; none that ends at the program's own clip (it bounds the steps' updates)."""
    if len(fin) < options["min-steps"] or any(v <= 0 for _, v in fin) or _clipped(fin[-1][1], limit):
        return None
    logs = [math.log(v) for _, v in fin]
    rho = spearman(list(range(len(fin))), logs)
    first, last = quarter_medians([v for _, v in fin])
    if first <= 0 or last / first < options["growth-ratio"] or rho < options["min-correlation"]:
        return None
    per_step = math.exp((logs[-1] - logs[0]) / (len(fin) - 1))
    return {"first": first, "last": last, "ratio": round(last / first, 3), "spearman": round(rho, 3),
            "per_step": round(per_step, 3)}


def _percentile(xs: list[float], p: float) -> float | None:
    xs = sorted(x for x in xs if finite(x))
    if not xs:
        return None
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _round2(x: float | None) -> float | None:
    if x is None or x <= 0 or not math.isfinite(x):
        return None
    return float(f"{x:.2g}")


def clip_edit(file: str, line: int, max_norm: float) -> Edit | None:
    """Insert gradient clipping before the `opt.step()` / `scaler.step(opt)` statement on `line`
    (unscaling first under a GradScaler). Offered only when the file imports torch."""
    parsed = parse_file(file)
    if parsed is None or line > len(parsed[1]):
        return None
    tree, lines = parsed
    if not any(isinstance(n, ast.Import) and any(a.name == "torch" and a.asname is None for a in n.names)
               for n in tree.body):
        return None
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Expr) and node.lineno == line and node.end_lineno == line
                and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute)
                and node.value.func.attr == "step"):
            continue
        call = node.value
        receiver = ast.get_source_segment("\n".join(lines), call.func.value)
        opt = ast.get_source_segment("\n".join(lines), call.args[0]) if call.args else receiver
        if not receiver or not opt:
            return None
        text = lines[line - 1]
        indent = text[:len(text) - len(text.lstrip())]
        # Statements before the step on its line (`opt.zero_grad(); loss.backward(); opt.step()`)
        # stay before the clipping: clipping ahead of the backward would clip the gradients it
        # is about to zero. ast columns count UTF-8 bytes.
        raw = text.encode()
        before = raw[:node.col_offset].decode().rstrip()
        if before.strip():
            if not before.endswith(";"):
                return None
            before = before[:-1].rstrip()
        new = [before] if before.strip() else []
        if call.args and "unscale_(" not in "\n".join(lines):
            new.append(f"{indent}{receiver}.unscale_({opt})")
        new.append(f'{indent}torch.nn.utils.clip_grad_norm_([p for g in {opt}.param_groups for p in g["params"]], '
                   f"max_norm={max_norm:g})")
        new.append(indent + raw[node.col_offset:].decode())
        return Edit(file=file, start=line, end=line, lines=new)
    return None
