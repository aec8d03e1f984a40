"""checkpoint-health: a checkpoint's weights and optimizer state are finite but not healthy."""
from __future__ import annotations

from typing import Iterable

import re

import msgspec

from auditor.evidence import model as m
from auditor.rules.base import Option, Options, Rule
from auditor.findings import Finding, Fix

FP16_MAX = 65504.0


class CheckpointHealth(Rule):
    """
    What it detects:
        In a checkpoint read by `audit checkpoint` (non-finite values are nonfinite's, the lr
        against a config is lr-schedule's):
        (1) weights whose largest |value| exceeds `extreme-abs`, and float16 tensors above
        `fp16-margin` of float16's range (65504): one more step of growth overflows;
        (2) optimizer state that no optimizer can produce: negative `exp_avg_sq` (Adam's second
        moment is a running mean of squares), a sign of a corrupted or wrongly-mapped state;
        (3) parameters listed in the optimizer with no state, while others have it: they never
        received a gradient (frozen, unused, or the state belongs to a different model);
        (4) a Lightning callback's record of a monitored metric that was NaN or inf: ModelCheckpoint
        keeps a NaN score as the mode's worst (+inf for mode="min") in `current_score`,
        `best_model_score` or `best_k_models`. A score at the value the callback starts from
        (`kth_value` before save_top_k scores are kept, EarlyStopping's `best_score` before its
        first improvement) is no fault and is not reported.

    Why it costs:
        Resuming from such a checkpoint diverges or silently trains the wrong thing: weights that
        have already exploded, moments that do not match their parameters.

    Example:
        bad:   opt.load_state_dict(torch.load("ckpt.pt")["optimizer"])  # state of another model
        good:  resume only from checkpoints whose model and optimizer state were saved together

    Fix:
        Resume from an earlier checkpoint; check what kept growing (see grad-explosion with
        `audit run`); save model and optimizer state from the same objects.

    Evidence needed:
        A checkpoint (`audit checkpoint FILE`).
    """

    id = "checkpoint-health"
    title = "Checkpoint weights or optimizer state are out of range"
    severity = "warning"
    category = "numerics"
    needs = frozenset({"checkpoint"})
    options = (
        Option("extreme-abs", 1e4, "Weights with a larger |value| are reported as extreme."),
        Option("fp16-margin", 0.5, "float16 tensors above this share of 65504 are reported.", high=1),
    )

    def skip_reason(self, ev: m.Evidence) -> str | None:
        if ev.checkpoint is None:
            return "needs a checkpoint (`audit checkpoint FILE`)"
        return None

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        ck = ev.checkpoint
        tensors = [t for t in ck.tensors if t.checked]
        # (max_abs is None when a tensor has no finite value: no magnitude to judge, and nonfinite reports it)
        sized = [t for t in tensors if t.max_abs is not None]
        extreme = [t for t in sized if t.section == "model" and t.max_abs > options["extreme-abs"]]
        near16 = [t for t in sized if t.dtype == "float16" and t.max_abs > options["fp16-margin"] * FP16_MAX]
        if extreme or near16:
            worst = sorted(extreme + [t for t in near16 if t not in extreme], key=lambda t: -t.max_abs)
            shown = ", ".join(f"{t.name} (max |w| {t.max_abs:.3g})" for t in worst[:5])
            yield self.finding(
                "The checkpoint holds extreme values: resume from an earlier one. "
                f"{len(worst)} tensor{'s' if len(worst) > 1 else ''} in {ck.file} hold{'' if len(worst) > 1 else 's'} extreme values: {shown}"
                f"{' …' if len(worst) > 5 else ''}"
                + (f"; {len(near16)} float16 tensors are above {options['fp16-margin']:.0%} of float16's range" if near16 else "")
                + ".",
                evidence={"extreme": msgspec.to_builtins(worst[:50]), "threshold": options["extreme-abs"],
                          "fp16_near_limit": len(near16), "largest_abs": worst[0].max_abs},
                fix=Fix(summary="Resume from an earlier checkpoint, before the weights grew; clip gradients and lower "
                                "the learning rate (audit run shows which layers' gradients dominate).", config={}))
        bad_moments = [t for t in tensors if t.section == "optimizer" and t.name.endswith("exp_avg_sq") and t.negative]
        if bad_moments:
            yield self.finding(
                "The optimizer state holds impossible values: do not load it. "
                f"{len(bad_moments)} exp_avg_sq tensors in {ck.file} hold negative values "
                f"({', '.join(t.name + ': ' + str(t.negative) for t in bad_moments[:4])}): Adam's second moment "
                "cannot be negative, so this state is corrupted or belongs to other parameters.",
                severity="error", title="Optimizer state is impossible",
                evidence={"tensors": msgspec.to_builtins(bad_moments[:50])},
                fix=Fix(summary="Do not load this optimizer state; save model and optimizer state from the same objects.",
                        config={}))
        for o in ck.optimizers:
            missing = o.params - o.params_with_state
            if o.params_with_state and missing > 0:
                yield self.finding(
                    "Some parameters have no optimizer state: check they are trained. "
                    f"{missing} of {o.params} parameters in {o.name} have no optimizer state in {ck.file}: "
                    "they never received a gradient (frozen or unused), or the state is another model's.",
                    severity="info", title="Parameters without optimizer state",
                    evidence={"optimizer": o.name, "params": o.params, "params_with_state": o.params_with_state,
                              "step_min": o.step_min, "step_max": o.step_max},
                    fix=Fix(summary="Check that every trainable parameter is used in the loss; pass frozen ones to no "
                                    "optimizer.", config={}))
        yield from self._metrics_gone(ck)

    def _metrics_gone(self, ck) -> Iterable[Finding]:
        """One finding per Lightning callback whose scores record a monitored metric that was not finite."""
        by_callback: dict[str, list] = {}
        for t in ck.tensors:
            if t.score == "not-finite":
                # (named "callbacks.<state key>.<score>", the state key ending in "}")
                key, _, score = t.name.removeprefix("callbacks.").rpartition("}.")
                by_callback.setdefault(key + "}", []).append((score, t))
        for key, scores in by_callback.items():
            monitor = (m.group(1) if (m := re.search(r"'monitor':\s*'([^']*)'", key)) else "the monitored metric")
            kept = [s for s, _ in scores if s.startswith("best_k_models.")]
            named = [s for s, _ in scores if not s.startswith("best_k_models.")]
            if kept:
                named.append(f"{len(kept)} of best_k_models")
            values = sorted({"+inf" if t.posinf else "-inf" if t.neginf else "nan" for _, t in scores})
            yield self.finding(
                "A monitored metric was NaN or inf: find where it broke. "
                f"{key.partition('{')[0]} for {monitor} in {ck.file} kept {'/'.join(values)} as {', '.join(named)}: "
                f"{monitor} was NaN or inf when it was checked (Lightning keeps a NaN score as the mode's worst "
                "value); the weights saved with it may be what made it so.",
                title="A monitored metric was not finite",
                evidence={"callback": key, "monitor": monitor, "scores": [s for s, _ in scores],
                          "tensors": msgspec.to_builtins([t for _, t in scores][:50])},
                fix=Fix(summary=f"Find where {monitor} stopped being finite (`audit run` on the training script) and "
                                "resume from a checkpoint saved before it.", config={}))
