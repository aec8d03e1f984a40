"""amp-unscaled: float16 autocast training without loss scaling, or a GradScaler that keeps
skipping steps."""
from __future__ import annotations

from typing import Any, Iterable

from auditor.evidence import model as m
from auditor.rules.base import Option, Options, Rule
from auditor.findings import Finding, Fix
from auditor.fixes import insert_before, replace_in_line
from auditor.evidence.numerics import val
from auditor.evidence.numerics_view import NumericsView
from auditor.rules._support.numerics_evidence import NEEDS_NUMERICS, location, needs_numerics, short


class AmpUnscaled(Rule):
    """
    What it detects:
        (1) Steps that run a backward pass after a float16 `torch.autocast` region, with no
        GradScaler scaling the loss (none created, created with enabled=False, or never called),
        judged step by step: steps trained unscaled before a scaler came into use are reported.
        (2) float16 weights (`model.half()`) updated by the optimizer from float16 gradients: no
        float32 master weights and no loss scale.
        (4) Gradients clipped while the GradScaler's scale is still in them:
        `clip_grad_norm_` / `clip_grad_value_` between `scaler.scale(loss).backward()` and
        `scaler.step(opt)` with no `scaler.unscale_(opt)` before it.
        (3) A GradScaler whose scale keeps falling: after its first run of falls from init_scale
        (calibration), at least `min-skipped` updates and `skipped-share` of them lowered the scale
        because the gradients held inf/NaN, so those optimizer steps were skipped; or it fell in
        every update, more than `max-calibration` times.

    Why it costs:
        float16 has 10 bits of mantissa and flushes values below ~6e-8 to zero: small gradients
        vanish without a loss scale, and training stalls or drifts without any error. A scaler that
        halves its scale every step means most steps are thrown away. Clipping scaled gradients
        measures a norm `scale` times the true one (65536x at first), so the threshold is in effect
        divided by the scale: nearly every update is shrunk, silently.

    Example:
        bad:   with torch.autocast("cuda", dtype=torch.float16): loss = model(x)
               loss.backward(); opt.step()
        good:  scaler = torch.amp.GradScaler("cuda")
               scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
        bad:   scaler.scale(loss).backward(); clip_grad_norm_(params, 1.0); scaler.step(opt)
        good:  scaler.scale(loss).backward(); scaler.unscale_(opt); clip_grad_norm_(params, 1.0)

    Fix:
        Use a GradScaler with float16, or autocast to bfloat16 (same range as float32, no scaler
        needed). For a collapsing scale, find the op that overflows (see nonfinite) and keep it in
        float32, or lower the learning rate. The bfloat16 edit changes results.

    Evidence needed:
        A run with the numerics collector (autocast regions, GradScaler calls and scale values).
    """

    id = "amp-unscaled"
    title = "float16 mixed precision without working loss scaling"
    severity = "warning"
    category = "numerics"
    needs = frozenset({"run"})
    needs_text = NEEDS_NUMERICS
    options = (
        Option("min-skipped", 3, "Scaler updates that lowered the scale before a collapse is reported."),
        Option("skipped-share", 0.25, "Share of scaler updates that lowered the scale to report a collapse."),
        Option("max-calibration", 12, "Falls in a row from init_scale that are still calibration, not collapse."),
    )

    def skip_reason(self, ev: m.Evidence) -> str | None:
        return needs_numerics(ev)

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        view = NumericsView.of(ev)
        yield from self._unscaled(view, ev.environment.rehearsal)
        yield from self._half_weights(view)
        yield from self._clipped_scaled(view)
        yield from self._collapse(view, options)

    def _clipped_scaled(self, view: NumericsView) -> Iterable[Finding]:
        """Gradient clipping that ran on scaled gradients (no unscale_ before it)."""
        sites: dict[tuple, list[dict]] = {}
        for e in view.events_of("clip_scaled"):
            w = e.get("where") or {}
            sites.setdefault((w.get("file"), w.get("line")), []).append(e)
        made = {e.get("scaler"): e for e in view.events_of("grad_scaler")}
        for (file, line), evs in sites.items():
            e = evs[0]
            steps = sorted({x["step"] for x in evs if isinstance(x.get("step"), int) and x["step"] >= 0})
            if not steps:
                continue
            scale = _scale_at(view, e.get("scaler"), steps[0]) or val((made.get(e.get("scaler")) or {}).get("init_scale"))
            limit, fn = val(e.get("limit")), e.get("fn") or "clip_grad_norm_"
            what = "max_norm" if fn == "clip_grad_norm_" else "clip_value"
            scaler_name, opt_name = e.get("scaler_name") or "scaler", e.get("opt_name") or "optimizer"
            bound = ("a norm of at most {}" if fn == "clip_grad_norm_" else "values within +-{}")
            effect = (f", and the gradients {opt_name} stepped with were cut to {bound.format(short(limit / scale))} "
                      f"instead of {short(limit)}" if limit is not None and scale else "")
            loc = location(e.get("where"))
            made_at = location((made.get(e.get("scaler")) or {}).get("where"))
            edit = insert_before(file, line, f"{scaler_name}.unscale_({opt_name})") if file and line else None
            yield self.finding(
                "Gradients are clipped while still scaled: unscale them first. "
                f"The call {fn}({what}={short(limit)}) ran on gradients still multiplied by the GradScaler's scale "
                f"({_factor(scale)} at step {steps[0]}) in {len(steps)} of {len(view.steps)} steps: no "
                f"{scaler_name}.unscale_({opt_name}) came before it, so it measured gradients {_factor(scale)} "
                f"times too large{effect}.",
                title="Gradients clipped while still scaled by the GradScaler",
                locations=[x for x in (loc, made_at) if x],
                evidence={"fn": fn, what.replace("_", "-"): limit, "scale": scale, "steps": len(steps),
                          "steps_run": len(view.steps), "first_step": steps[0],
                          "scaler": scaler_name, "optimizer": opt_name},
                fix=Fix(summary=f"Unscale before clipping: {scaler_name}.unscale_({opt_name}) right before "
                                f"{fn}(...); {scaler_name}.step({opt_name}) then does not unscale again.",
                        config={"GradScaler.unscale_before_clipping": True},
                        edits=[edit] if edit else [], changes_numerics=True))

    def _half_weights(self, view: NumericsView) -> Iterable[Finding]:
        """float16 weights (`model.half()`) updated from float16 gradients: no float32 master
        weights and no loss scale (a GradScaler refuses float16 gradients)."""
        steps, per_opt = [], {}
        for i, d in view.steps:
            half = [(r.opt, r.fp16_grads, r.site) for r in d.opt_steps if r.fp16_grads]
            if half:
                steps.append(i)
                for opt, n, site in half:
                    per_opt.setdefault(opt, (n, site))
        if not steps:
            return
        made = {e.get("opt"): e for e in view.events_of("optimizer")}
        locs = [x for x in (location((made.get(o) or {}).get("where")) for o in sorted(per_opt)) if x]
        kinds = sorted({(made.get(o) or {}).get("type") or "optimizer" for o in per_opt})
        adam = any(k.startswith("Adam") for k in kinds)
        n = sum(v[0] for v in per_opt.values())
        yield self.finding(
            "float16 weights without loss scaling: keep them in float32. "
            f"{n} parameters are float16 and {', '.join(kinds)} updated them from float16 gradients in "
            f"{len(steps)} of {len(view.steps)} steps, with no float32 master weights and no loss scale: gradients "
            "below ~6e-8 flush to zero, updates smaller than a weight's float16 resolution are lost"
            + (", and Adam's eps (1e-8) is 0 in float16, so a zero second moment divides by zero" if adam else "")
            + ".",
            title="float16 weights trained without master weights or loss scaling",
            locations=locs,
            evidence={"fp16_params": n, "steps": len(steps), "steps_run": len(view.steps), "optimizers": kinds},
            fix=Fix(summary="Keep the weights in float32 (do not call model.half()) and run the forward pass under "
                            "torch.autocast(dtype=torch.float16) with a GradScaler, or use torch.bfloat16.",
                    config={"weights.dtype": "float32", "autocast.dtype": "float16", "GradScaler": True},
                    changes_numerics=True))

    def _unscaled(self, view: NumericsView, rehearsal: bool = False) -> Iterable[Finding]:
        fp16 = {e["site"]: e for e in view.events_of("autocast") if e.get("dtype") == "float16" and e.get("enabled")}
        if not fp16:
            return
        used: dict[int, int] = {}
        steps, backward, scaled = [], 0, []
        for i, d in view.steps:
            # judged step by step: a program may train without a scaler, then with one (pytorch/
            # tutorials' mixed_precision: autocast alone, then autocast and GradScaler)
            if d.scaler_scale_calls:
                scaled.append(i)
                continue
            sites = [s for s, n in d.autocast if s in fp16]
            if not sites or not d.backward:
                continue
            steps.append(i)
            backward += d.backward
            for s in sites:
                used[s] = used.get(s, 0) + 1
        if not steps:
            return
        scalers = view.events_of("grad_scaler")
        disabled = [s for s in scalers if not s.get("enabled")]
        why = ("a GradScaler was created with enabled=False" if disabled else
               f"no GradScaler scaled the loss in them (one did in {len(scaled)} other checked step(s), "
               f"from step {scaled[0]})" if scaled else
               "a GradScaler was created but never scaled the loss" if scalers else "no GradScaler was created")
        locs = [x for x in (location(fp16[s].get("where")) for s in sorted(used)) if x]
        locs += [x for x in (location(s.get("where")) for s in disabled) if x]
        # (a rehearsal ran the CUDA autocast on the CPU: the program's own device is "cuda")
        device = "cuda" if rehearsal else next(iter(fp16[s].get("device") for s in used), "cuda")
        edits = [e for e in (self._bf16_edit(fp16[s].get("where")) for s in sorted(used)) if e]
        yield self.finding(
            "float16 without loss scaling: use a GradScaler or bfloat16. "
            f"The float16 autocast ran in {len(steps)} of {len(view.steps)} steps with a backward pass "
            f"({backward} backward calls) and {why}: gradients below ~6e-8 flush to zero in float16.",
            locations=locs,
            evidence={"steps": len(steps), "steps_run": len(view.steps), "backward_calls": backward,
                      "autocast_sites": [{"site": s, "uses": n, "device": fp16[s].get("device")} for s, n in used.items()],
                      "scaler_scale_calls": 0, "grad_scalers": len(scalers), "disabled_scalers": len(disabled)},
            fix=Fix(summary=f"Scale the loss: scaler = torch.amp.GradScaler(\"{device}\"); "
                            "scaler.scale(loss).backward(); scaler.step(opt); scaler.update() — or autocast to "
                            "torch.bfloat16, which needs no scaler.",
                    config={"GradScaler": f"torch.amp.GradScaler(\"{device}\")", "autocast.dtype": "bfloat16"},
                    edits=edits, changes_numerics=True))

    @staticmethod
    def _bf16_edit(where: dict | None):
        if not where:
            return None
        for old in ("torch.float16", "torch.half"):
            e = replace_in_line(where["file"], int(where["line"]), old, "torch.bfloat16")
            if e:
                return e
        return None

    def _collapse(self, view: NumericsView, options: dict) -> Iterable[Finding]:
        per: dict[int, list[tuple[int, float | None, float | None]]] = {}
        for i, d in view.steps:
            for u in d.scaler_updates:
                per.setdefault(u.scaler, []).append((i, val(u.before), val(u.after)))
        for idx, ups in sorted(per.items()):
            fell = [b is not None and a is not None and a < b for _, b, a in ups]
            lead = next((k for k, f in enumerate(fell) if not f), len(fell))  # calibration from init_scale
            skipped = [u for u, f in zip(ups, fell) if f]
            later = fell[lead:]
            share = sum(later) / len(later) if later else 1.0
            never_settled = lead == len(fell) and lead >= options["max-calibration"]
            if not never_settled and (sum(later) < options["min-skipped"] or share < options["skipped-share"]):
                continue
            made = next((e for e in view.events_of("grad_scaler") if e.get("scaler") == idx), None)
            loc = location(made.get("where")) if made else None
            first = next((b for _, b, _ in ups if b is not None), None)
            last = ups[-1][2]
            how = ("in every update, never settling" if never_settled else
                   f"in {sum(later)} of the {len(later)} updates after its first {lead} calibration steps")
            yield self.finding(
                "The GradScaler skips steps: find where inf/NaN comes from. "
                f"The GradScaler lowered its scale {how} (from {short(first)} to {short(last)}): the scaled gradients "
                f"held inf/NaN and {len(skipped)} of {len(ups)} optimizer steps were skipped.",
                locations=[loc] if loc else [],
                evidence={"updates": len(ups), "skipped": len(skipped), "calibration_updates": lead,
                          "skipped_after_calibration": sum(later), "skipped_share": round(share, 3),
                          "first_scale": first, "last_scale": last,
                          "series": [[i, a] for i, _, a in ups][:200], "skipped_steps": [i for i, _, _ in skipped][:200]},
                fix=Fix(summary="Find the op that overflows float16 (nonfinite names it) and run it in float32, lower the "
                                "learning rate, or autocast to bfloat16.",
                        config={"autocast.dtype": "bfloat16"}, changes_numerics=True))


def _scale_at(view: NumericsView, scaler: Any, step: int) -> float | None:
    """The scale the scaler had in `step` (before that step's update)."""
    for i, d in view.steps:
        if i == step:
            for u in d.scaler_updates:
                if u.scaler == scaler:
                    return val(u.before)
    return None


def _factor(x: float | None) -> str:
    """A scale as people write it: 65536, not 6.55e+04."""
    return f"{x:.0f}" if x is not None and 1 <= x < 1e15 and x == int(x) else short(x)
