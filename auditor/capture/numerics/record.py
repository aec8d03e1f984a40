"""The step's record, built at its end from the values read back once (see values.Values).

The record's schema is auditor.evidence.numerics.NumericsStep; the parent converts this dict to it.
"""
from __future__ import annotations

import math
from typing import Any

from auditor.capture.numerics.values import _finite, _scalar, num

MAX_ORIGINS = 3  # steps for which the origin of non-finite values is worked out and sent
MAX_HAZARD_SITES = 64


class StepRecordBuilder:
    """Mixin of Numerics: the step's record (`_materialise`) and its optimizer steps' records."""

    def _materialise(self, index: int) -> dict[str, Any]:
        vals = self.values.read()
        data: dict[str, Any] = {"ops": len(self.ops), "dropped": self.dropped, "backward": self.backward}
        bad_ops = []
        hazards: dict[int, float] = {}
        for k, op in enumerate(self.ops):
            if not op:  # a deferred call the loss showed finite
                continue
            site, _, _, out_refs, hazard, half, kind, _ = op
            if not all(_finite(vals[r], vals[r + 1]) for r in out_refs):
                bad_ops.append(k)
            if hazard is not None or half:
                v = _hazard_value(hazard, vals) if hazard is not None else None
                if half:
                    r = out_refs[0]
                    v = max(abs(vals[r]), abs(vals[r + 1])) if v is None else v
                if v is None or (len(hazards) >= MAX_HAZARD_SITES and site not in hazards):
                    continue
                prev = hazards.get(site)
                low = hazard is not None and hazard[0] != "max_in"
                # (a later call at the same line that received a NaN does not hide how close the
                # first came to its hazard: NaN only when no call there measured a number)
                if prev is None or math.isnan(prev):
                    hazards[site] = v
                elif not math.isnan(v):
                    hazards[site] = min(prev, v) if low else max(prev, v)
        data["nonfinite_ops"] = len(bad_ops)
        data["nonfinite_sites"] = sorted({self.ops[k][0] for k in bad_ops})
        data["hazards"] = [[s, num(v)] for s, v in hazards.items()]
        loss_vals = [(vals[r], vals[r + 1]) for r in self.losses]
        if loss_vals:
            lo, hi = loss_vals[-1]
            data["loss"] = num(hi if lo == hi or math.isnan(hi) else (lo + hi) / 2)
        data["losses"] = len(loss_vals)
        loss_bad = any(not _finite(lo, hi) for lo, hi in loss_vals)
        data["loss_finite"] = not loss_bad if loss_vals else None
        data["opt_steps"] = [self._opt_record(r, vals) for r in self.opt_steps]
        grads_bad = any(r.get("grad_nonfinite") for r in data["opt_steps"])
        params_bad = any(r.get("param_nonfinite") for r in data["opt_steps"])
        data["autocast"] = [[s, n] for s, n in self.autocast_used.items()]
        data["scaler_scale_calls"] = self.scale_calls
        data["scaler_updates"] = [{"scaler": i, "before": num(vals[b]) if b is not None else None,
                                   "after": num(vals[a])} for i, b, a in self.scaler_updates]
        if loss_bad or grads_bad or params_bad:
            if self.origins < MAX_ORIGINS:
                self.origins += 1
                data["origin"] = self._origin(index, vals, bad_ops, hazards, loss_bad, data["opt_steps"])
        else:
            # (a call with weights among its inputs that overflows is never by design: a float16
            # Linear at ±inf that a ReLU hides is the NaN of a later step, not an attention mask)
            self.benign_sites.update(self.ops[k][0] for k in bad_ops if not self._weighted(self.ops[k]))
        return data

    def _opt_record(self, r: dict, vals: list) -> dict[str, Any]:
        """One optimizer step's record. The per-parameter values go out as they are, with the id
        of their names in `param_lists`; which parameters and layers dominate is worked out by the
        reader (auditor.evidence.numerics.NumericsView), not here, in every training step."""
        out = {"opt": r["opt"], "site": r["site"], "sched_epochs": r["sched_epochs"],
               "lrs": [num(vals[v[1]]) if isinstance(v, tuple) else _scalar(v) for v in r["lrs"]]}
        if "grad_norms" in r:
            norms = vals[r["grad_norms"]]
            names, _, lid = r["grad_list"]
            out["grads"] = lid
            if all(map(math.isfinite, norms)):
                out["grad_norm"] = num(math.hypot(*norms))
                out["grad_norms"] = norms
                out["grad_nonfinite"] = 0
            else:
                out["grad_norm"] = "nan"
                out["grad_norms"] = [num(n) for n in norms]
                bad = [names[i] for i, n in enumerate(norms) if not math.isfinite(n)]
                out["grad_nonfinite"] = len(bad)
                out["grad_nonfinite_params"] = bad[:20]
        if r.get("no_grads"):
            out["no_grads"] = True
        if r.get("fp16_grads"):
            out["fp16_grads"] = r["fp16_grads"]
        if r.get("compiled"):
            out["compiled"] = True
        if r.get("param_trusted"):
            out["params_checked"] = "trusted"  # a safe update of finite weights (see _update_keeps_finite)
        if "param_maxabs" in r:
            out["params_checked"] = "measured"
            # (min, max) per parameter on the CPU, max|w| (one value) on CUDA
            maxabs = [_max_abs(vals[a], vals[b] if b is not None else vals[a]) for a, b in r["param_maxabs"]]
            names = r["param_list"][0]
            bad = [names[i] for i, n in enumerate(maxabs) if not math.isfinite(n)]
            out["param_max_abs"] = num(max(maxabs) if not bad else float("nan"))
            out["param_nonfinite"] = len(bad)
            out["param_nonfinite_params"] = bad[:20]
        return out


def _max_abs(lo: float, hi: float) -> float:
    return max(abs(lo), abs(hi)) if _finite(lo, hi) else float("nan")


def _hazard_value(hazard: tuple, vals: list) -> float | None:
    what, ref = hazard
    if what == "min_abs_den_const":
        return ref
    return vals[ref]
