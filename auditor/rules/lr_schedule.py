"""lr-schedule: the learning rate the optimizer really used differs from what the configuration
says, or grows without bound. Also compares a checkpoint's stored lr with a config file."""
from __future__ import annotations

import ast
import math
from bisect import bisect_right
from typing import Any, Callable, Iterable

from auditor.evidence import model as m
from auditor.evidence.checkpoint_summary import CheckpointSummary
from auditor.rules.base import Option, Options, Rule
from auditor.findings import Edit, Finding, Fix, Location
from auditor.fixes import parse_file
from auditor.evidence.numerics import val
from auditor.evidence.numerics_view import NumericsView
from auditor.rules._support.numerics_evidence import finite, location, short

# Closed forms of the built-in schedulers: lr at `last_epoch` e from the base lr b and the
# scheduler's constructor arguments a (what `_get_closed_form_lr` computes in torch).
CLOSED_FORMS: dict[str, Callable[[float, int, dict], float]] = {
    "StepLR": lambda b, e, a: b * a["gamma"] ** (e // a["step_size"]),
    "MultiStepLR": lambda b, e, a: b * a["gamma"] ** bisect_right(a["milestones"], e),
    "ConstantLR": lambda b, e, a: b * (a["factor"] if e < a["total_iters"] else 1.0),
    "LinearLR": lambda b, e, a: b * (a["start_factor"] + (a["end_factor"] - a["start_factor"])
                                     * min(a["total_iters"], e) / a["total_iters"]),
    "ExponentialLR": lambda b, e, a: b * a["gamma"] ** e,
    "CosineAnnealingLR": lambda b, e, a: a["eta_min"] + (b - a["eta_min"]) * (1 + math.cos(math.pi * e / a["T_max"])) / 2,
    "PolynomialLR": lambda b, e, a: b * (1 - min(a["total_iters"], e) / a["total_iters"]) ** a["power"],
}
# Schedulers whose own arguments make the lr rise above the optimizer's lr, and by how much.
PEAK: dict[str, Callable[[dict], float]] = {
    "LinearLR": lambda a: max(a.get("start_factor", 1.0), a.get("end_factor", 1.0), 1.0),
    "ConstantLR": lambda a: max(a.get("factor", 1.0), 1.0),
}


# The constructor arguments that make a built-in scheduler's schedule (the rest is its state).
_ARGS = ("step_size", "gamma", "milestones", "factor", "start_factor", "end_factor", "total_iters", "T_max",
         "eta_min", "power")


class LrSchedule(Rule):
    """
    What it detects:
        On a run, per optimizer: (1) an `optimizer.load_state_dict` (or a scheduler's) that replaced
        the learning rate the code configured, with the line that did it; (2) a learning rate that
        differs by more than `rtol` from what its built-in scheduler (StepLR, MultiStepLR,
        ConstantLR, LinearLR, ExponentialLR, CosineAnnealingLR, PolynomialLR) implies at its
        current epoch, from the arguments it was constructed with, or two of one type with the
        same arguments on one optimizer (a copy that still names the first optimizer: the lr
        takes both factors, and another optimizer goes without); (3) a runaway learning rate: at
        least `runaway-ratio` times the configured one (or a OneCycle/Cyclic peak) and still rising
        when the audit ended, e.g. a warm-up lambda without a cap. The observed series is
        `param_groups[i]["lr"]` read at each `optimizer.step()`.
        On a checkpoint with `--against CONFIG`: the stored lr / initial_lr / scheduler base_lrs and
        other optimizer settings against the config's, and whether resuming reproduces the config.

    Why it costs:
        A wrong learning rate is silent: training runs, just worse or divergent. Resuming from a
        checkpoint quietly keeps the old lr whatever the config now says; an uncapped warm-up keeps
        raising the lr until the loss explodes.

    Example:
        bad:   LambdaLR(opt, lambda s: (s + 1) / warmup)            # never stops rising
        good:  LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))

    Fix:
        Cap the warm-up; after `load_state_dict`, set the lr you mean (or rebuild the scheduler);
        let one scheduler own each optimizer. Edits change results and stay out of fixes.patch
        unless asked for.

    Evidence needed:
        A run with the numerics collector, or `audit checkpoint FILE --against CONFIG`.
    """

    id = "lr-schedule"
    title = "Learning rate differs from the configuration or runs away"
    severity = "warning"
    category = "numerics"
    needs = frozenset({"run", "checkpoint"})
    needs_text = "needs a run with the numerics collector, or a checkpoint with --against"
    options = (
        Option("rtol", 0.01, "Relative difference between observed and expected lr that counts."),
        Option("runaway-ratio", 4.0, "An lr this many times the configured peak and still rising is runaway."),
    )

    def skip_reason(self, ev: m.Evidence) -> str | None:
        if ev.source == "checkpoint":
            ck = ev.checkpoint
            return None if ck is not None and ck.config else "needs --against CONFIG to compare with"
        if not any(s.numerics is not None for s in ev.steps):
            return self.needs_text
        return None

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        if ev.source == "checkpoint":
            yield from self._checkpoint(ev.checkpoint, options)
            return
        view = NumericsView.of(ev)
        series: dict[int, list[tuple[int, list]]] = {}
        epochs: dict[int, list[tuple[int, dict]]] = {}
        for step, r in view.opt_steps():
            series.setdefault(r.opt, []).append((step, r.lrs or []))
            epochs.setdefault(r.opt, []).append((step, r.sched_epochs or {}))
        for opt, obs in sorted(series.items()):
            created = view.optimizer_event(opt)
            scheds = [e for e in view.events_of("scheduler") if e.get("opt") == opt]
            found = list(self._loaded(view, opt, created, obs, options))
            if not found and len(scheds) == 1:
                found += self._closed_form(scheds[0], obs, epochs[opt], created, options)
            if not found:
                found += self._twins(view, created, scheds, obs, epochs[opt], options)
            found += self._runaway(created, scheds, obs, options)
            yield from found

    # --- (1) state loads that replace the configured lr ------------------------------------------

    def _loaded(self, view: NumericsView, opt: int, created: dict | None, obs: list, options: dict) -> Iterable[Finding]:
        configured = val(created.get("lr")) if created else None
        for e in view.events_of("optimizer.load_state_dict"):
            if e.get("opt") != opt:
                continue
            before, after = [val(x) for x in e.get("lr_before") or []], [val(x) for x in e.get("lr_after") or []]
            changed = [(i, b, a) for i, (b, a) in enumerate(zip(before, after))
                       if b is not None and a is not None and _differs(a, b, options["rtol"])]
            if not changed:
                continue
            i, b, a = changed[0]
            first = _first_observed(obs, i)
            loc, made = location(e.get("where")), location(created.get("where")) if created else None
            msg = ("Loaded optimizer state replaced the learning rate: set it again. "
                   f"The call optimizer.load_state_dict at {_at(loc)} replaced the learning rate the code configured "
                   f"({short(configured if configured is not None else b)}"
                   f"{' at ' + _at(made) if made else ''}) with {short(a)} from the loaded state"
                   + (f"; the run trained at {short(first[1])} from step {first[0]}" if first else "") + ".")
            yield self.finding(
                msg, locations=[x for x in (loc, made) if x],
                evidence={"configured_lr": configured, "lr_before": e.get("lr_before"), "lr_after": e.get("lr_after"),
                          "initial_lr_after": e.get("initial_lr_after"), "group": i,
                          "loaded_at_step": e.get("step"), "observed": _series(obs, i)},
                fix=Fix(summary="After loading the optimizer state, set the lr you mean (for g in opt.param_groups: "
                                "g['lr'] = g['initial_lr'] = LR) or keep the checkpoint's lr on purpose and drop it from the config.",
                        config={"lr": configured} if configured is not None else {},
                        edits=_after_load_edit(loc, configured), changes_numerics=True))
        for e in view.events_of("scheduler.load_state_dict"):
            before, after = e.get("base_lrs_before") or [], e.get("base_lrs_after") or []
            sched = next((s for s in view.events_of("scheduler") if s.get("sched") == e.get("sched")), None)
            if not sched or sched.get("opt") != opt or not any(
                    finite(b) and finite(a) and _differs(val(a), val(b), options["rtol"]) for b, a in zip(before, after)):
                continue
            loc = location(e.get("where"))
            yield self.finding(
                "Loaded scheduler state replaced its learning rates: rebuild it. "
                f"The call {e.get('type', 'scheduler')}.load_state_dict at {_at(loc)} replaced its base learning rates "
                f"{[short(x) for x in before]} (from the optimizer's configured lr) with {[short(x) for x in after]} "
                f"and last_epoch {e.get('last_epoch_before')} with {e.get('last_epoch_after')}.",
                locations=[loc] if loc else [],
                evidence={"base_lrs_before": before, "base_lrs_after": after,
                          "last_epoch_before": e.get("last_epoch_before"), "last_epoch_after": e.get("last_epoch_after")},
                fix=Fix(summary="Rebuild the scheduler from the config after loading, or keep the stored schedule on purpose.",
                        config={}))

    # --- (2) a built-in scheduler's closed form ---------------------------------------------------

    def _closed_form(self, sched: dict, obs: list, epochs: list, created: dict | None, options: dict) -> list[Finding]:
        form = CLOSED_FORMS.get(sched.get("type", ""))
        bases = [val(b) for b in sched.get("base_lrs") or []]
        if form is None or not bases or any(b is None for b in bases):
            return []
        key = str(sched.get("sched"))
        for (step, lrs), (_, ep) in zip(obs, epochs):
            e = ep.get(key)
            if e is None:
                continue
            for i, (b, got) in enumerate(zip(bases, lrs)):
                got = val(got)
                try:
                    want = form(b, int(e), sched.get("attrs") or {})
                except (KeyError, TypeError, ZeroDivisionError, ValueError):
                    return []
                if got is None or not _differs(got, want, options["rtol"]):
                    continue
                loc = location(sched.get("where"))
                args = ", ".join(f"{k}={v}" for k, v in (sched.get("attrs") or {}).items() if k in _ARGS)
                return [self.finding(
                    "Something else changes the learning rate: let one scheduler own it. "
                    f"At step {step} the optimizer's lr was {short(got)}, but {sched['type']}({args}) at {_at(loc)} "
                    f"implies {short(want)} at its epoch {e} (base lr {short(b)}): something else changes the lr "
                    "(code writing param_groups, or a second scheduler).",
                    locations=[loc] if loc else [],
                    evidence={"scheduler": sched["type"], "attrs": sched.get("attrs"), "base_lr": b, "epoch": e,
                              "expected": want, "observed": got, "step": step, "group": i, "series": _series(obs, i)},
                    fix=Fix(summary="Let one scheduler own the optimizer's lr; remove other writes to param_groups['lr'].",
                            config={}))]
        return []

    # --- (2b) the same scheduler twice on one optimizer ----------------------------------------

    def _twins(self, view: NumericsView, created: dict | None, scheds: list[dict], obs: list, epochs: list,
               options: dict) -> list[Finding]:
        """Two built-in schedulers of one type and the same arguments on one optimizer, both stepped:
        the lr takes each one's factor, so it follows neither. Chaining schedulers is legal (a
        warm-up then a decay), but nobody chains a scheduler with its own copy: it is a copy-paste
        that still names the first optimizer, and another optimizer goes without."""
        groups: dict[tuple, list[dict]] = {}
        for sc in scheds:
            if sc.get("type") in CLOSED_FORMS:
                args = tuple(sorted((k, repr(v)) for k, v in (sc.get("attrs") or {}).items() if k in _ARGS))
                groups.setdefault((sc["type"], args), []).append(sc)
        for (kind, _), same in groups.items():
            if len(same) < 2:
                continue
            a, form = same[0], CLOSED_FORMS[kind]
            bases = [val(b) for b in a.get("base_lrs") or []]
            for (step, lrs), (_, ep) in zip(obs, epochs):
                e = ep.get(str(a.get("sched")))
                if e is None or not bases or bases[0] is None or not lrs or val(lrs[0]) is None:
                    continue
                try:
                    one = form(bases[0], int(e), a.get("attrs") or {})
                except (KeyError, TypeError, ZeroDivisionError, ValueError):
                    return []
                got = val(lrs[0])
                if not _differs(got, one, options["rtol"]):
                    continue
                locs = [x for x in (location(sc.get("where")) for sc in same) if x]
                primary = locs[::-1]  # (the last one made is the likelier copy)
                made = location(created.get("where")) if created else None
                others = [o for o in view.events_of("optimizer")
                          if o.get("opt") != a.get("opt")
                          and not any(sc.get("opt") == o.get("opt") and sc.get("type") == kind
                                      for sc in view.events_of("scheduler"))]
                args = ", ".join(f"{k}={v}" for k, v in (a.get("attrs") or {}).items() if k in _ARGS)
                count = "Two" if len(same) == 2 else str(len(same))
                at = " and ".join([", ".join(_at(x) for x in locs[:-1]), _at(locs[-1])] if len(locs) > 1
                                  else [_at(x) for x in locs])
                msg = ("One optimizer has copies of one scheduler: keep one. "
                       f"{count} {kind}({args}) schedulers{', at ' + at + ',' if at else ''} drive one optimizer"
                       + (f" (the {created.get('type', 'optimizer')} at {_at(made)})" if created else "")
                       + f": its lr takes {'both' if len(same) == 2 else 'all their'} factors, so at step {step} it "
                       f"was {short(got)} where one {kind} gives {short(one)}.")
                if others:
                    o = others[0]
                    msg += (f" The {o.get('type', 'optimizer')} at {_at(location(o.get('where')))} has no {kind}: "
                            "did the copy mean it?")
                return [self.finding(
                    msg, locations=primary,
                    evidence={"scheduler": kind, "attrs": a.get("attrs"), "schedulers": len(same), "step": step,
                              "observed": got, "one_scheduler": one, "epoch": e, "base_lr": bases[0],
                              "optimizers_without": [o.get("opt") for o in others], "series": _series(obs, 0)},
                    fix=Fix(summary=f"Give each optimizer its own {kind} (name the other optimizer in the copy), or "
                                    "keep one scheduler with the combined factor if the faster decay is meant.",
                            config={}, changes_numerics=True))]
        return []

    # --- (3) runaway ------------------------------------------------------------------------------

    def _runaway(self, created: dict | None, scheds: list[dict], obs: list, options: dict) -> list[Finding]:
        lrs = [(s, val(v[0])) for s, v in obs if v and finite(v[0])]
        configured = val(created.get("lr")) if created else None
        if len(lrs) < 4 or not configured or configured <= 0:
            return []
        peak = configured
        for s in scheds:
            attrs = s.get("attrs") or {}
            maxes = [val(x) for x in (attrs.get("group_max_lrs") or attrs.get("max_lrs") or []) if finite(x)]
            if maxes:
                peak = max(peak, *maxes)
            if s.get("type") in PEAK:
                peak = max(peak, configured * PEAK[s["type"]](attrs))
        values = [v for _, v in lrs]
        top, last = max(values), values[-1]
        rising = last >= top * 0.999 and last > values[len(values) // 2] * (1 + options["rtol"])
        if top / peak < options["runaway-ratio"] or not rising:
            return []
        owner = scheds[-1] if scheds else None
        loc = location(owner.get("where")) if owner else (location(created.get("where")) if created else None)
        edit = _cap_lambda_edit(loc) if owner and owner.get("type") in ("LambdaLR", "MultiplicativeLR") and loc else None
        what = f"{owner['type']} at {_at(loc)}" if owner else f"code changing param_groups['lr'] (optimizer at {_at(loc)})"
        return [self.finding(
            "The learning rate keeps rising past its setting: cap it. "
            f"The learning rate ran away: {short(values[0])} at step {lrs[0][0]} to {short(last)} at step {lrs[-1][0]}, "
            f"{top / peak:.1f}x the configured {short(peak)}, and still rising when the audit ended ({what}).",
            locations=[loc] if loc else [],
            evidence={"configured_lr": configured, "peak_allowed": peak, "max_lr": top, "ratio": round(top / peak, 3),
                      "scheduler": owner.get("type") if owner else None, "series": [[s, v] for s, v in lrs][:200]},
            fix=Fix(summary="Cap the warm-up factor at 1 (lambda s: min(1.0, (s + 1) / warmup)), or hand over to a "
                            "decaying schedule when the warm-up ends (SequentialLR).",
                    config={"warmup.max_factor": 1.0}, edits=[edit] if edit else [], changes_numerics=True))]

    # --- a checkpoint against a config --------------------------------------------------------------

    def _checkpoint(self, ck: CheckpointSummary, options: dict) -> Iterable[Finding]:
        cfg = ck.config or {}
        mismatches = []
        for oi, o in enumerate(ck.optimizers):
            for gi, g in enumerate(o.param_groups):
                for key, stored_key in (("lr", "initial_lr"), ("lr", "lr"), ("weight_decay", "weight_decay"),
                                        ("momentum", "momentum"), ("eps", "eps"), ("betas", "betas")):
                    if key not in cfg or stored_key not in g:
                        continue
                    if key == "lr" and stored_key == "lr" and "initial_lr" in g:
                        continue  # with a scheduler the current lr is the schedule's, initial_lr is the config's
                    if _value_differs(g[stored_key], cfg[key], options["rtol"]):
                        mismatches.append({"key": key, "config": cfg[key], "stored": g[stored_key],
                                           "where": f"optimizer[{oi}].param_groups[{gi}].{stored_key}"})
        sched_cfg = cfg.get("scheduler") or {}
        for si, s in enumerate(ck.schedulers):
            if "lr" in cfg and s.get("base_lrs"):
                for bi, b in enumerate(s["base_lrs"]):
                    if _value_differs(b, cfg["lr"], options["rtol"]):
                        mismatches.append({"key": "lr", "config": cfg["lr"], "stored": b,
                                           "where": f"scheduler[{si}].base_lrs[{bi}]"})
            for key, want in sched_cfg.items():
                if key in s and key not in ("type", "name") and _value_differs(s[key], want, options["rtol"]):
                    mismatches.append({"key": f"scheduler.{key}", "config": want, "stored": s[key],
                                       "where": f"scheduler[{si}].{key}"})
        if not mismatches:
            return
        shown = "; ".join(f"{x['where']} = {x['stored']} (config {x['key']} = {x['config']})" for x in mismatches[:4])
        current = [g.get("lr") for o in ck.optimizers for g in o.param_groups]
        yield self.finding(
            "The checkpoint does not match the config: set them after loading. "
            f"Resuming from {ck.file} does not reproduce {ck.config_file}: {shown}"
            f"{' …' if len(mismatches) > 4 else ''}. optimizer.load_state_dict / scheduler.load_state_dict would "
            "silently keep the stored values.",
            evidence={"file": ck.file, "config_file": ck.config_file, "mismatches": mismatches,
                      "reproduces_config": False, "stored_lr": current, "config": cfg},
            fix=Fix(summary="After loading, set the config's values on the optimizer's param groups (lr and initial_lr) "
                            "and rebuild the scheduler, or update the config to match the checkpoint.",
                    config={x["key"]: x["config"] for x in mismatches}, changes_numerics=True))


def _differs(a: float, b: float, rtol: float) -> bool:
    return abs(a - b) > rtol * max(abs(a), abs(b)) + 1e-15


def _value_differs(stored: Any, want: Any, rtol: float) -> bool:
    if isinstance(stored, (list, tuple)) and isinstance(want, (list, tuple)):
        return len(stored) != len(want) or any(_value_differs(s, w, rtol) for s, w in zip(stored, want))
    s, w = val(stored), val(want)
    if s is None or w is None:
        return stored != want
    return _differs(s, w, rtol)


def _series(obs: list, group: int) -> list[list]:
    return [[s, v[group]] for s, v in obs if len(v) > group][:200]


def _first_observed(obs: list, group: int) -> tuple[int, Any] | None:
    return next(((s, v[group]) for s, v in obs if len(v) > group), None)


def _at(loc: Location | None) -> str:
    return f"{loc.file.rsplit('/', 1)[-1]}:{loc.line}" if loc else "an unknown line"


def _after_load_edit(loc: Location | None, lr: float | None) -> list[Edit]:
    """`for g in OPT.param_groups: g["lr"] = g["initial_lr"] = LR` after the load statement."""
    if loc is None or lr is None:
        return []
    parsed = parse_file(loc.file)
    if parsed is None:
        return []
    tree, lines = parsed
    for node in ast.walk(tree):
        if (isinstance(node, ast.Expr) and node.lineno == loc.line == node.end_lineno
                and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute)
                and node.value.func.attr == "load_state_dict"):
            opt = ast.get_source_segment("\n".join(lines), node.value.func.value)
            text = lines[loc.line - 1]
            indent = text[:len(text) - len(text.lstrip())]
            return [Edit(file=loc.file, start=loc.line, end=loc.line, lines=[
                text, f'{indent}for _g in {opt}.param_groups:  # keep the configured lr on resume',
                f'{indent}    _g["lr"] = _g["initial_lr"] = {lr!r}'])]
    return []


def _cap_lambda_edit(loc: Location) -> Edit | None:
    """Wrap the body of the lr lambda on the scheduler's line in min(1.0, ...)."""
    parsed = parse_file(loc.file)
    if parsed is None:
        return None
    tree, lines = parsed
    for node in ast.walk(tree):
        if isinstance(node, ast.Lambda) and node.lineno == loc.line and node.body.lineno == node.body.end_lineno == loc.line:
            raw = lines[loc.line - 1].encode()
            body = raw[node.body.col_offset:node.body.end_col_offset].decode()
            new = raw[:node.body.col_offset].decode() + f"min(1.0, {body})" + raw[node.body.end_col_offset:].decode()
            return Edit(file=loc.file, start=loc.line, end=loc.line, lines=[new])
    return None
