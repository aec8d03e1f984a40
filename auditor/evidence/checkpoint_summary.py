"""What `audit checkpoint` read from a checkpoint: `Evidence.checkpoint` (auditor.evidence.checkpoint
builds it; the rules nonfinite, lr-schedule and checkpoint-health and the reports read it).

Non-finite floats in scalar values (an lr, a logged loss) are the strings "nan", "inf", "-inf": JSON
has no NaN.
"""
from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType


class TensorStats(msgspec.Struct):
    """One tensor of the checkpoint.

    name: its dotted path in the checkpoint ("model.fc.weight", "optimizer.state.0.exp_avg_sq").
    section: model | optimizer | callback (a training framework's callback state: Lightning's
    `callbacks`) | other.
    dtype: torch's name without "torch." ("float16").
    numel, shape: its size.
    The counts below are UNSET (absent from the JSON) for a tensor that holds no real floating-point
    values (integers, bool, complex, sparse, empty, and meta tensors, which have no data): only
    floating-point tensors are checked. A view that repeats its storage (torch.expand) is checked
    by its storage's values.
    nan, posinf, neginf: how many of its values are NaN, +inf, -inf.
    max_abs: its largest finite |value|; None when it holds no finite value at all.
    negative, zeros: how many values are < 0 and == 0.
    score: for a monitored score a framework's callback keeps (see auditor.evidence.callback_scores:
    Lightning's ModelCheckpoint `kth_value`, `best_model_score`, `current_score`, `best_k_models`,
    EarlyStopping's `best_score`), what its value means there: "start" (the value the callback
    starts from, before it has a score), "not-finite" (the monitored metric was NaN or inf when it
    was checked: ModelCheckpoint keeps a NaN as the mode's worst, ±inf) or "finite"; UNSET for
    every other tensor."""

    name: str
    section: str
    dtype: str
    numel: int
    shape: list[int]
    nan: int | UnsetType = UNSET
    posinf: int | UnsetType = UNSET
    neginf: int | UnsetType = UNSET
    max_abs: float | None | UnsetType = UNSET
    negative: int | UnsetType = UNSET
    zeros: int | UnsetType = UNSET
    score: str | UnsetType = UNSET

    @property
    def checked(self) -> bool:
        """Whether its values were checked (a floating-point tensor with values)."""
        return self.max_abs is not UNSET

    @property
    def nonfinite(self) -> int:
        """How many of its values are NaN or inf (0 when not checked)."""
        return (self.nan or 0) + (self.posinf or 0) + (self.neginf or 0)

    @property
    def sentinel(self) -> bool:
        """A callback's score at the value it starts from, not weights gone bad: a known framework
        score as its `score` says (Lightning's ModelCheckpoint starts `kth_value` at +inf for
        mode="min" until save_top_k scores are kept); other callback state whose only non-finite
        values are infinities (a callback of the user's own keeping a best score). A NaN there is a
        monitored metric that was NaN."""
        if self.score is not UNSET:
            return self.score == "start" and self.nonfinite > 0
        return self.section == "callback" and not self.nan and self.nonfinite > 0

    @property
    def bad(self) -> bool:
        """Whether it holds NaN/inf that stand for values gone bad: not a sentinel, and not a
        framework's record of a monitored metric that was not finite (checkpoint-health names that:
        the score is not the checkpoint's weights or optimizer state)."""
        return self.nonfinite > 0 and not self.sentinel and self.score != "not-finite"


class OptimizerSummary(msgspec.Struct):
    """One optimizer state_dict of the checkpoint.

    name: where it was found ("optimizer", "optimizer_states.0").
    param_groups: each param group's scalar settings (lr, initial_lr, betas, weight_decay, ...;
    "params" left out).
    params: how many parameters its groups list; params_with_state: how many have state.
    state_keys: the kinds of per-parameter state it holds (exp_avg, exp_avg_sq, step, ...).
    step_min, step_max: the smallest and largest per-parameter `step`, None without one."""

    name: str
    param_groups: list[dict[str, Any]] = []
    params: int = 0
    params_with_state: int = 0
    state_keys: list[str] = []
    step_min: int | float | None = None
    step_max: int | float | None = None


class Totals(msgspec.Struct):
    """tensors: how many tensors were checked; values: their elements in all."""

    tensors: int = 0
    values: int = 0


class TrainingLog(msgspec.Struct, omit_defaults=True):
    """A Hugging Face trainer_state.json in brief.

    global_step, epoch: where training stopped (as the file says; None when it does not).
    entries: how many log_history entries it holds.
    first_nonfinite: the first logged loss / grad_norm / eval_loss that was not finite: {"step",
    "epoch", "key", "value", "learning_rate", "last_finite" (the last finite loss, grad_norm,
    learning_rate and their step before it)}; absent when none was.
    last: the last entry's step, loss, grad_norm, learning_rate (those it has); absent when the
    history is empty or a non-finite entry was found."""

    global_step: Any
    epoch: Any
    entries: int
    first_nonfinite: dict[str, Any] | None = None
    last: dict[str, Any] | None = None


class CheckpointSummary(msgspec.Struct, omit_defaults=True):
    """A checkpoint's contents as the rules read them.

    file: the checkpoint file or directory, as given.
    bytes: the bytes read.
    layout: state_dict | bundle | lightning | optimizer | hf-trainer | other.
    tensors: every tensor found (weights, optimizer state, other tensors).
    optimizers: every optimizer state_dict found.
    schedulers: every LR scheduler's scalar state (base_lrs, last_epoch, step_size, gamma, ...), with
    "name", where it was found.
    meta: the checkpoint's other scalars (epoch, global_step; a safetensors file's
    "__metadata__.<key>" entries).
    totals: tensors and values checked.
    training_log: trainer_state.json in brief (a Hugging Face checkpoint directory only).
    files: a checkpoint directory's files by part ("model": weights files, "optimizer", "scheduler",
    "training_log").
    shards: a sharded checkpoint's weight file of each tensor ("model.<name>" -> path).
    config, config_file: with --against, the config's accepted values (lr, weight_decay, momentum,
    eps, betas, "scheduler": {key: value}) and its path."""

    file: str
    bytes: int
    layout: str = "other"
    tensors: list[TensorStats] = []
    optimizers: list[OptimizerSummary] = []
    schedulers: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    totals: Totals = msgspec.field(default_factory=Totals)
    training_log: TrainingLog | None = None
    files: dict[str, list[str]] | None = None
    shards: dict[str, str] | None = None
    config: dict[str, Any] | None = None
    config_file: str | None = None
