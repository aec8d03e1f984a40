"""Trainer frameworks' settings behind the calls they make inside a user's `trainer.train()` /
`trainer.fit()` line: a probed call's `via` (the library functions between the user's line and
the call, innermost first, see capture.frames.library_via) names the framework code that made it,
and this table the setting that makes that code run every step. The fix is that setting, as
config: the user's line only calls into the framework, so no edit of it is the fix."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable


@dataclass(frozen=True)
class Setting:
    """A framework setting: `where` matches a via entry ("file:qualname" suffix); `innermost`: only
    when that function made the call itself (the via's first entry); `what`: only these probed
    calls (empty: any)."""

    where: str
    config: dict[str, Any]
    advice: str
    innermost: bool = False
    what: tuple[str, ...] = ()


SETTINGS = (
    Setting("transformers/trainer.py:Trainer._maybe_log_save_evaluate",
            {"TrainingArguments.logging_steps": ">= 50"},
            "the Trainer reads the loss back to the host at each log (`TrainingArguments(logging_steps=1)` "
            "logs every step): log every 50 or more steps"),
    Setting("transformers/trainer.py:Trainer._run_epoch", {"TrainingArguments.logging_nan_inf_filter": False},
            "the Trainer tests each step's loss for NaN/Inf on the host (`logging_nan_inf_filter=True`, the "
            "default): `TrainingArguments(logging_nan_inf_filter=False)`", innermost=True, what=("bool(Tensor)",)),
    Setting("transformers/trainer.py:Trainer._inner_training_loop", {"TrainingArguments.torch_empty_cache_steps": None},
            "the Trainer empties the CUDA cache every `torch_empty_cache_steps` steps: leave it unset",
            innermost=True, what=("torch.cuda.empty_cache",)),
    # transformers' attention-mask builders read a 2D attention_mask back to the host at every forward
    # (`padding_mask.all()`) to drop an all-ones mask, so SDPA can take its fastest kernel; a batch
    # without one (None) is read nothing of (transformers/masking_utils.py)
    Setting("transformers/masking_utils.py:_ignore_bidirectional_mask_sdpa",
            {"batch.attention_mask": "left out where no token is padding"},
            "transformers reads each forward's attention_mask back to the host to drop it when no token is "
            "padding (SDPA's fastest kernel takes no mask): batches without padding (fixed-length or packed "
            "sequences) can leave `attention_mask` out of the inputs; padded batches keep this sync",
            what=("bool(Tensor)",)),
    Setting("transformers/masking_utils.py:_ignore_causal_mask_sdpa",
            {"batch.attention_mask": "left out where no token is padding"},
            "transformers reads each forward's attention_mask back to the host to use SDPA's causal kernel "
            "without a mask when no token is padding: batches without padding (fixed-length or packed "
            "sequences) can leave `attention_mask` out of the inputs; padded batches keep this sync",
            what=("bool(Tensor)",)),
    Setting("lightning/pytorch/trainer/connectors/logger_connector/result.py:_ResultMetric.compute",
            {"LightningModule.log": "sync_dist=True only with on_step=False"},
            "`self.log(..., sync_dist=True)` reduces the value across processes at every step: log it per "
            "epoch (on_step=False) or without sync_dist"),
    Setting("lightning/fabric/utilities/apply_func.py:convert_tensors_to_scalars",
            {"Trainer.enable_progress_bar": False, "LightningModule.log": "prog_bar=False"},
            "Lightning reads every metric logged with `prog_bar=True` back to the host at each progress-bar "
            "refresh: `Trainer(enable_progress_bar=False)`, or log with prog_bar=False"),
    Setting("lightning/pytorch/callbacks/progress/", {"Trainer.enable_progress_bar": False},
            "the progress bar refreshes every step: `Trainer(enable_progress_bar=False)`"),
)


def settings_for(what: str, via: str) -> list[Setting]:
    """The settings behind a call `what` made through `via` ("" when the user's code made it)."""
    if not via:
        return []
    chain = via.split(" < ")
    return [s for s in SETTINGS
            if (not s.what or what in s.what)
            and any(s.where in entry for entry in (chain[:1] if s.innermost else chain))]


def framework_fix(places: Iterable[Any]) -> tuple[dict[str, Any], list[str]]:
    """(config, advice) of the framework settings behind `places` (rules' Place: `what`, `vias`)."""
    config: dict[str, Any] = {}
    advice: list[str] = []
    for p in places:
        for via in sorted(p.vias):
            for s in settings_for(p.what, via):
                config.update(s.config)
                if s.advice not in advice:
                    advice.append(s.advice)
    return config, advice


# DataLoaders a framework builds from its own arguments: the DataLoader keyword each of its settings
# sets. `where` matches an entry of the loader's `via` (the framework code that constructed it).
LOADER_SETTINGS: tuple[tuple[str, dict[str, str]], ...] = (
    ("transformers/trainer.py:Trainer.", {
        "num_workers": "TrainingArguments.dataloader_num_workers",
        "pin_memory": "TrainingArguments.dataloader_pin_memory",
        "persistent_workers": "TrainingArguments.dataloader_persistent_workers",
        "prefetch_factor": "TrainingArguments.dataloader_prefetch_factor",
    }),
)


def loader_settings(via: str) -> dict[str, str] | None:
    """For a DataLoader a framework built (its `via`): DataLoader keyword -> the framework setting
    that sets it; None when the user's code built it (the keyword is then set at the user's call)."""
    if not via:
        return None
    chain = via.split(" < ")
    for where, names in LOADER_SETTINGS:
        if any(where in entry for entry in chain):
            return names
    return None
