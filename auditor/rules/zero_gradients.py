"""zero-gradients: every gradient the optimizer is given is exactly zero, step after step."""
from __future__ import annotations

from typing import Iterable

from auditor.evidence import model as m
from auditor.evidence.numerics import OptStep, val
from auditor.evidence.numerics_view import NumericsView
from auditor.findings import Finding, Fix
from auditor.rules.base import Option, Options, Rule
from auditor.rules._support.numerics_evidence import NEEDS_NUMERICS, needs_numerics, site_location

# The loss functions whose site names the loss the gradients come from (torch.nn.functional's, as
# the numerics collector records their calls, and nn's loss modules through them).
LOSS_OPS = ("cross_entropy", "nll_loss", "binary_cross_entropy", "mse_loss", "l1_loss", "smooth_l1_loss",
            "huber_loss", "kl_div", "ctc_loss", "margin_ranking_loss", "cosine_embedding_loss",
            "soft_margin_loss", "multilabel_soft_margin_loss", "hinge_embedding_loss", "poisson_nll_loss",
            "gaussian_nll_loss", "triplet_margin_loss", "multi_margin_loss")


class ZeroGradients(Rule):
    """
    What it detects:
        An optimizer whose global gradient norm (all its parameters, measured just before each
        `optimizer.step()`) was exactly 0.0 at every one of at least `min-steps` steps measured,
        or none of whose parameters had a gradient at all at any of them though each step ran a
        backward pass (`zero_grad()` between `backward()` and `step()`: every `.grad` None, and
        the update skips them): its updates change nothing the data could teach. Where the loss
        did not move, the finding names the loss's line (the loss function the step called) and,
        where it was 0 and came from cross_entropy, the usual cause: an output of one column,
        whose log-softmax over a single class is 0 for any input. Where the loss moved, it
        depends on the output, so the gradients were lost on their way to the update: the
        finding names the optimizer step's line and the causes (zero_grad(set_to_none=False)
        between backward() and step(), or a graph that never reaches the parameters).

    Why it costs:
        The run trains for as long as it is let and learns nothing, and nothing fails: no NaN, no
        error, a loss that stays put. pytorch/examples' DDP tutorial trains nn.Linear(20, 1) on
        random pairs with cross_entropy this way.

    Example:
        bad:   loss = F.cross_entropy(model(x), y)          # model(x) has 1 column, y a float target
        good:  loss = F.mse_loss(model(x), y)               # a regression target
               loss = F.binary_cross_entropy_with_logits(model(x), y)  # a binary one

    Fix:
        A loss that did not move: make it depend on the model's output (for a target of one value
        per sample, a regression loss (mse_loss) or a binary one (binary_cross_entropy_with_logits);
        for classes, an output with one column per class). Gradients lost on the way: call
        zero_grad() before backward() (or after step()), never between them, and make the
        optimizer from the parameters the forward pass uses, after the model is built.

    Evidence needed:
        A run with the numerics collector on (the default), with `min-steps` optimizer steps
        measured.
    """

    id = "zero-gradients"
    title = "The gradients are exactly zero at every step"
    severity = "warning"
    category = "numerics"
    needs = frozenset({"run"})
    needs_text = NEEDS_NUMERICS
    options = (
        Option("min-steps", 5, "Optimizer steps with a measured gradient norm needed, every one of them exactly 0.",
               low=1),
    )

    def skip_reason(self, ev: m.Evidence) -> str | None:
        return needs_numerics(ev)

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        view = NumericsView.of(ev)
        backward = {i: d.backward for i, d in view.steps}
        by_opt: dict[int, list[tuple[int, OptStep]]] = {}
        for step, r in view.opt_steps():
            if (r.grad_norm is not None and r.grad_norms) or (r.no_grads and backward.get(step)):
                by_opt.setdefault(r.opt, []).append((step, r))
        for opt, recs in sorted(by_opt.items()):
            if len(recs) < options["min-steps"]:
                continue
            if all(r.no_grads for _, r in recs):
                yield self._none(view, opt, recs)
            elif all(not r.no_grads and val(r.grad_norm) == 0.0 for _, r in recs):
                yield self._zeros(view, opt, recs)

    def _none(self, view: NumericsView, opt: int, recs: list[tuple[int, OptStep]]) -> Finding:
        """No parameter had a gradient at any step measured, though each ran a backward pass."""
        name = _optimizer_name(view, opt)
        loc = site_location(view, recs[0][1].site)
        steps = [s for s, _ in recs]
        return self.finding(
            "No gradients reach the optimizer: check zero_grad() and the model. "
            f"None of the parameters {name} updates had a gradient at any of the {len(recs)} optimizer steps "
            f"measured (steps {steps[0]}-{steps[-1]}), though each step ran a backward pass: every update skips "
            "every parameter. The gradients were set to None between backward() and step() (zero_grad(), whose "
            "default is set_to_none=True, called there), or the loss's graph does not reach the parameters the "
            "optimizer holds (a model made again after the optimizer, a detach or no_grad in the forward).",
            locations=[loc] if loc else [],
            evidence={"optimizer": name, "steps_measured": len(recs), "steps": steps[:200], "no_grads": True,
                      "losses": [val(v) for _, v in view.loss_series()][:200],
                      "lrs": [val(x) for x in (recs[-1][1].lrs or [])]},
            fix=Fix(summary="Call zero_grad() before backward() (or after step()), never between them, and make "
                            "the optimizer from the parameters the forward pass uses, after the model is built.",
                    changes_numerics=True),
        )

    def _zeros(self, view: NumericsView, opt: int, recs: list[tuple[int, OptStep]]) -> Finding:
        """Every gradient exactly zero at every step measured."""
        name = _optimizer_name(view, opt)
        losses = [val(v) for _, v in view.loss_series()]
        loss_sites = sorted({k for k, s in view.sites.items() if s.op and s.op.rsplit(".", 1)[-1] in LOSS_OPS})
        loss_site = view.site(loss_sites[0]) if loss_sites else None
        steps = [s for s, _ in recs]
        constant = bool(losses) and all(v == losses[0] for v in losses)
        # a loss that does not move has no gradient: its line; one that moves depends on the output,
        # so the gradients were lost on their way to the update: the optimizer step's line
        step_loc = site_location(view, recs[0][1].site)
        loss_loc = site_location(view, loss_sites[0]) if loss_sites else None
        loc = (loss_loc or step_loc) if constant or not losses else (step_loc or loss_loc)
        where = f"The loss at line {loss_loc.line}" if loss_loc else "The loss"
        said_loss = (f" {where} was {losses[0] + 0.0:g} at every one of the {len(losses)} checked steps." if constant
                     else f" {where} moved between {min(losses):g} and {max(losses):g}." if losses else "")
        cause = ""
        moved = bool(losses) and not constant
        if constant and losses[0] == 0.0 and loss_site is not None and loss_site.op.endswith("cross_entropy"):
            cause = (" A cross_entropy that is 0 for any input has one class: an output of one column, whose "
                     "log-softmax over a single class is 0 (a regression target wants mse_loss, a binary one "
                     "binary_cross_entropy_with_logits).")
        elif moved:
            cause = (" A loss that moves depends on the model's output, so its gradients were lost before the "
                     "update: cleared between backward() and step() (zero_grad(set_to_none=False) there), or "
                     "never reaching these parameters (a detach, .data or no_grad in the forward, with the "
                     "gradients zeroed at the step's start).")
        msg = (("Every gradient is zero: check where zero_grad() runs. " if moved else
                "Every gradient is zero: make the loss depend on the output. ")
               + f"The gradients {name} was given were exactly zero at every one of the {len(recs)} optimizer steps "
               f"measured (steps {steps[0]}-{steps[-1]}): its updates change nothing the data could teach."
               + said_loss + cause)
        return self.finding(
            msg, locations=[loc] if loc else [],
            evidence={"optimizer": name, "steps_measured": len(recs), "steps": steps[:200], "loss_moved": moved,
                      "losses": losses[:200], "loss_constant": constant,
                      "loss_op": loss_site.op if loss_site is not None else None,
                      "lrs": [val(x) for x in (recs[-1][1].lrs or [])]},
            fix=Fix(summary=("Call zero_grad() before backward() (or after step()), never between them, and keep "
                             "the forward's graph attached to the parameters the optimizer holds (no detach, .data "
                             "or no_grad on the way to the loss)." if moved else
                             "Make the loss depend on the model's output: for one target value per sample, "
                             "mse_loss (regression) or binary_cross_entropy_with_logits (binary); for classes, "
                             "an output with one column per class. Check that the optimizer holds the "
                             "parameters the forward pass uses."),
                    changes_numerics=True),
        )


def _optimizer_name(view: NumericsView, opt: int) -> str:
    """The optimizer's class, as its "optimizer" event names it."""
    made = view.optimizer_event(opt)
    return made.get("type") if made else "the optimizer"
