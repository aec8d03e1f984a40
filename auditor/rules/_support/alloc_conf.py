"""PYTORCH_CUDA_ALLOC_CONF as the allocator rules read and write it: its keys in order, a fix's
settings merged into the user's own."""
from __future__ import annotations

import re

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def split_conf(conf: str) -> dict[str, str]:
    """PYTORCH_CUDA_ALLOC_CONF as ordered key -> value ("k:v,k:v"; values may be "[a:b,c:d]")."""
    out: dict[str, str] = {}
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", conf or ""):
        key, _, value = item.strip().partition(":")
        if key:
            out[key.strip()] = value.strip()
    return out


def merge_conf(existing: str, **settings: str) -> str:
    """The user's PYTORCH_CUDA_ALLOC_CONF with `settings` added or replaced, other keys kept."""
    conf = split_conf(existing)
    conf.update(settings)
    return ",".join(f"{k}:{v}" for k, v in conf.items())
