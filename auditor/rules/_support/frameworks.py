"""Trainer frameworks' settings behind the calls they make inside a user's `trainer.train()` /
`trainer.fit()` line: a probed call's `via` (the library functions between the user's line and
the call, innermost first, see capture.frames.library_via) names the framework code that made it,
and this table the setting that makes that code run every step. The fix is that setting, as
config: the user's line only calls into the framework, so no edit of it is the fix.

Read from a program's source (`trains_with`): the Lightning Fabric, Trainer or LightningCLI its
code trains with, whose settings are the fixes' terms there (mixed precision is its `precision`;
Fabric copies the batches itself)."""
from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple

from auditor.fixes import call_name, parse_file


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


# --- the framework a program's own code trains with --------------------------------------------

class Trains(NamedTuple):
    """Where a program's code hands its training to Lightning: `kind` "fabric" (`Fabric(...)`),
    "trainer" (`Trainer(...)`) or "cli" (`LightningCLI(...)`, whose Trainer the command line
    sets); the call's file and line, and the `precision` it gives (None when left to the default);
    for Fabric, the line of the first `.setup_dataloaders(...)` that moves batches to the device
    itself (move_to_device left True)."""

    kind: str
    file: str
    line: int
    precision: str | None = None
    moves_batches: int | None = None


_LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")
_KINDS = {"Fabric": "fabric", "Trainer": "trainer", "LightningCLI": "cli"}


def trains_with(files: Iterable[str | None]) -> Trains | None:
    """The first Lightning Fabric, Trainer or LightningCLI made in `files` (each read once, in
    order) that import Lightning; None when none does (see Trains)."""
    for file in dict.fromkeys(f for f in files if f):
        parsed = parse_file(file)
        if parsed is None or not _imports_lightning(parsed[0]):
            continue
        calls = sorted((n for n in ast.walk(parsed[0]) if isinstance(n, ast.Call)), key=lambda n: n.lineno)
        made = next((c for c in calls if call_name(c) in _KINDS), None)
        if made is None:
            continue
        kind = _KINDS[call_name(made) or ""]
        precision = next((k.value.value for k in made.keywords if k.arg == "precision"
                          and isinstance(k.value, ast.Constant)), None)
        moves = next((c.lineno for c in calls if call_name(c) == "setup_dataloaders" and not any(
            k.arg == "move_to_device" and isinstance(k.value, ast.Constant) and k.value.value is False
            for k in c.keywords)), None) if kind == "fabric" else None
        return Trains(kind, file, made.lineno, None if precision is None else str(precision), moves)
    return None


def _imports_lightning(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        if any(n.split(".")[0] in _LIGHTNING for n in names):
            return True
    return False


def framework_moves_batches(trains: Trains | None) -> str | None:
    """What to say of a pinned batch's copy where the framework makes it (Fabric's
    `setup_dataloaders`, a Trainer's own batch transfer: `.to(device, non_blocking=True)` inside
    Lightning): the user's step has no copy to change."""
    if trains is None or (trains.kind == "fabric" and trains.moves_batches is None):
        return None
    if trains.kind == "fabric":
        return (f"`fabric.setup_dataloaders` (line {trains.moves_batches}) moves the batches to the device itself, "
                "without blocking from pinned memory: there is no copy in the step to change")
    return ("Lightning's Trainer moves the batches to the device itself (its `transfer_batch_to_device`), without "
            "blocking from pinned memory: there is no copy in the step to change")


def mixed_precision(trains: Trains | None, bf16: bool | None = None) -> tuple[str, dict[str, Any]] | None:
    """(advice, config) for mixed precision in the framework's own terms: its `precision` setting,
    which runs the forward and loss under autocast (and, for "16-mixed", its own GradScaler).
    `bf16`: whether the GPU runs bfloat16 (None: not known, bf16 advised with fp16 before Ampere)."""
    if trains is None:
        return None
    value = "bf16-mixed" if bf16 is not False else "16-mixed"
    name = {"fabric": "Fabric", "trainer": "Trainer", "cli": "Trainer"}[trains.kind]
    older = (f" (\"16-mixed\", with {'Lightning' if trains.kind == 'cli' else name}'s own GradScaler, on GPUs "
             "before Ampere)" if bf16 is None else "")
    if trains.kind == "cli":
        return (f"Run it in mixed precision through its LightningCLI (line {trains.line}): `--trainer.precision "
                f"{value}` on the command line{older}", {"Trainer.precision": value})
    given = f" (it gives precision={trains.precision!r})" if trains.precision else ""
    return (f"Run it in mixed precision through {name}: `{name}(..., precision=\"{value}\")` at line {trains.line}"
            f"{given}{older}; {name} then runs the forward and loss under autocast", {f"{name}.precision": value})
