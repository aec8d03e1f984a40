"""What the monitored scores in a Lightning checkpoint's `callbacks` mean, as Lightning's own
sources define them (lightning/pytorch/callbacks/model_checkpoint.py and early_stopping.py, 2.x).

A callback's state is saved under its state key, the class name and its settings:
`ModelCheckpoint{'monitor': 'val_loss', 'mode': 'min', ...}`, `EarlyStopping{'monitor': ..., 'mode': ...}`.
  * ModelCheckpoint starts `kth_value` at the mode's worst, `torch.tensor(inf)` for "min" (-inf for
    "max"), and keeps it there until `save_top_k` scores are kept, when it sets `kth_best_model_path`
    (which starts as "") and `kth_value` to that path's score; `best_model_score` and
    `current_score` start as None. It keeps a NaN monitored value as that worst (`_update_best_and_save`:
    "do not save nan, replace with +/- inf"), so an infinite `current_score`, `best_model_score` or
    `best_k_models` entry is a monitored metric that was NaN or inf.
  * EarlyStopping starts `best_score` at +inf for "min" (-inf for "max") and replaces it only by a
    better finite score.
A subclass saves under its own class name and is judged as unknown callback state.
"""
from __future__ import annotations

import math
import re
from typing import Any

_MODE = re.compile(r"'mode':\s*'(min|max)'")
SCORES = {"ModelCheckpoint": ("kth_value", "best_model_score", "current_score", "best_k_models"),
          "EarlyStopping": ("best_score",)}
# the scores that start at the mode's worst value (the others start as None)
STARTS_AT_WORST = {("ModelCheckpoint", "kth_value"), ("EarlyStopping", "best_score")}


def _value(v: Any) -> float | None:
    import torch

    if isinstance(v, torch.Tensor) and v.numel() == 1 and v.is_floating_point():
        return float(v)
    return None


def callback_scores(callbacks: Any, prefix: str = "callbacks") -> dict[str, str]:
    """{tensor name, as the checkpoint walk names it: meaning} for the monitored scores of the
    Lightning callbacks in `callbacks`; meaning is "start", "not-finite" or "finite" (see
    TensorStats.score)."""
    out: dict[str, str] = {}
    if not isinstance(callbacks, dict):
        return out
    for key, state in callbacks.items():
        kind = next((k for k in SCORES if isinstance(key, str) and key.startswith(k + "{")), None)
        mode = _MODE.search(key) if kind else None
        if mode is None or not isinstance(state, dict):
            continue
        worst = math.inf if mode.group(1) == "min" else -math.inf
        kept = state.get("best_k_models") if isinstance(state.get("best_k_models"), dict) else {}
        top_k_full = bool(state.get("kth_best_model_path"))
        for name in SCORES[kind]:
            entries = ([(f"{name}.{p}", v) for p, v in kept.items()] if name == "best_k_models"
                       else [(name, state.get(name))])
            for label, v in entries:
                x = _value(v)
                if x is None:
                    continue
                if math.isfinite(x):
                    meaning = "finite"
                elif (kind, name) in STARTS_AT_WORST and x == worst and not (name == "kth_value" and top_k_full):
                    meaning = "start"
                else:
                    meaning = "not-finite"
                out[f"{prefix}.{key}.{label}"] = meaning
    return out
