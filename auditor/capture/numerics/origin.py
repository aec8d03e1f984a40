"""Where a step's non-finite values started: the call, the backward pass or the update."""
from __future__ import annotations

from typing import Any

from auditor.capture.numerics.ops import COMPILED, DIV, EXP, LOG, LOG1P, RDIV, SQRT
from auditor.capture.numerics.record import _hazard_value
from auditor.capture.numerics.values import _finite, num

FP16_MAX = 65504.0


class Origins:
    """Mixin of Numerics: the origin of a step's non-finite values (`_origin`)."""

    def _weighted(self, op: tuple) -> bool:
        """Whether a recorded call had one of the model's parameters among its inputs."""
        names = self.param_names
        return any((e := names.get(i)) is not None and e[0]() is not None for i in op[7])

    def _origin(self, index: int, vals: list, bad_ops: list[int], hazards: dict[int, float],
                loss_bad: bool, opt_steps: list[dict]) -> dict[str, Any]:
        """Where the step's non-finite values came from, in execution order: the first call at a
        site that has not made non-finite values in healthy steps (an attention mask's -inf is
        by design), else the backward pass, else the optimizer's update.

        A call that only received ±inf (no NaN) from a tensor no checked call of the step made
        (a mask written with `pad[:, 4:] = -inf`, first in a step too late for the healthy steps
        that teach what is by design) is blamed only if nothing else explains the step: a later
        call that made non-finite values from finite ones (a division by zero), or, when the loss
        stayed finite, the backward pass or the update. A later call that merely received
        non-finite values leaves the blame with it (a row masked whole: softmax of all -inf)."""
        what = [w for w, bad in (("loss", loss_bad), ("gradient", any(r.get("grad_nonfinite") for r in opt_steps)),
                                 ("parameter", any(r.get("param_nonfinite") for r in opt_steps))) if bad]
        base = {"step": index, "nonfinite": what, "ops_checked": len(self.ops),
                "hazards": [[s, num(v)] for s, v in hazards.items()]}
        made = {r for op in self.ops if op for r in op[3]}  # values the step's checked calls made
        fallback = None
        for k in bad_ops:
            site, module, in_refs, out_refs, hazard, half, kind, params = self.ops[k]
            if site in self.benign_sites:
                continue
            fn = next((name for a, b, name in self.backward_fns if a <= k < b), None)
            ins = [_range(vals, r, r in self.sym_refs) if r is not None else {"min": None, "max": None, "finite": True}
                   for r in in_refs]
            for r, rng in zip(in_refs, ins):
                if r in self.stale_refs:
                    rng["measured_at_step"] = self.stale_refs[r]
            for i, rng in enumerate(ins):
                name = self.param_names.get(params[i]) if params and i < len(params) else None
                if name is not None and name[0]() is not None:
                    rng["param"] = name[1]
            out = [_range(vals, r) for r in out_refs]
            cause = _cause(kind, hazard, vals, ins, out, half)
            if fn is not None:  # an op of a hand-written backward (see backward_probe)
                if cause["kind"] == "nonfinite-input":
                    continue  # a gradient that came in non-finite: made by the backward pass before it
                bad = next((r for r in opt_steps if r.get("grad_nonfinite")), None)
                return {**base, "phase": "backward", "function": fn, "op_index": k, "site": site,
                        "module": module, "inputs": ins[:8], "outputs": out[:4], "hazard": cause,
                        "params": bad["grad_nonfinite_params"] if bad else [],
                        **({"opt": bad["opt"]} if bad else {})}
            found = {**base, "phase": "input" if cause["kind"] == "nonfinite-input" else "forward",
                     "op_index": k, "site": site, "module": module, "inputs": ins[:8], "outputs": out[:4],
                     "hazard": cause}
            if cause["kind"] == "nonfinite-input":
                if all(r is not None and r not in made and "nan" not in (rng["min"], rng["max"])
                       for r, rng in zip(in_refs, ins) if not rng["finite"]):
                    fallback = fallback or found  # (an infinity from outside: a mask, by design, most likely)
                    continue
                if fallback is not None:  # passing on what came from outside: that was the start after all
                    return fallback
            return found
        if fallback is not None and loss_bad:
            return fallback
        for r in opt_steps:
            if r.get("grad_nonfinite"):
                hints = [[s, num(v)] for s, v in hazards.items() if v == 0.0]
                return {**base, "phase": "backward", "params": r["grad_nonfinite_params"], "opt": r["opt"],
                        "hazard": {"kind": "backward", "singular_sites": hints},
                        **({"site": self.backward_site} if self.backward_site is not None else {})}
            if r.get("param_nonfinite"):
                return {**base, "phase": "optimizer", "params": r["param_nonfinite_params"], "opt": r["opt"],
                        "site": r["site"], "hazard": {"kind": "update"}}
        return fallback or {**base, "phase": "unknown", "hazard": {"kind": "unknown"}}



def _range(vals: list, ref: int, symmetric: bool = False) -> dict[str, Any]:
    lo, hi = vals[ref], vals[ref + 1]
    out = {"min": num(lo), "max": num(hi), "finite": _finite(lo, hi)}
    if symmetric:
        out["abs"] = True  # a weight's range after an update: ±max|w|
    return out


def _cause(kind: int, hazard: tuple | None, vals: list, ins: list[dict], out: list[dict], half: bool) -> dict:
    """Name the hazard that turned finite inputs into a non-finite result."""
    if any(not r["finite"] for r in ins):
        bad = next(i for i, r in enumerate(ins) if not r["finite"])
        return {"kind": "nonfinite-input", "input": bad, "param": ins[bad].get("param")}
    v = _hazard_value(hazard, vals) if hazard is not None else None
    has_nan = any(o["min"] == "nan" or o["max"] == "nan" for o in out)
    has_inf = any(o["max"] == "inf" or o["min"] == "-inf" for o in out)
    if kind == COMPILED:  # (its own calls were not checked: which of them made it is not known)
        return {"kind": "compiled"}
    if kind in (LOG, LOG1P) and v is not None and v <= (-1.0 if kind == LOG1P else 0.0):
        return {"kind": "log-of-zero" if v == (-1.0 if kind == LOG1P else 0.0) else "log-of-negative",
                "min_input": num(v)}
    if kind in (DIV, RDIV) and v is not None and v == 0.0:
        return {"kind": "division-by-zero", "min_abs_denominator": 0.0}
    if kind == SQRT and v is not None and v < 0:
        return {"kind": "sqrt-of-negative", "min_input": num(v)}
    if kind == EXP and v is not None and has_inf:
        return {"kind": "exp-overflow", "max_input": num(v)}
    if half and (has_inf or any(isinstance(r.get(k), (int, float)) and abs(r[k]) > FP16_MAX
                                for r in ins for k in ("min", "max"))):
        # (a float32 input past 65504 that autocast casts to float16 inside the call: inf, then NaN)
        return {"kind": "fp16-overflow", "limit": FP16_MAX}
    if has_inf and not has_nan:
        return {"kind": "overflow"}
    return {"kind": "invalid"}  # NaN from finite inputs: inf - inf, 0 * inf, 0 / 0 inside the call

