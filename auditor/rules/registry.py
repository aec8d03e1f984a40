"""The rule registry: every rule, built-in or third-party, arrives through the `auditor.rules`
entry-point group, so the mechanism plugins use is the one the built-ins exercise every run."""
from __future__ import annotations

import importlib
from functools import lru_cache
from importlib.metadata import entry_points

from auditor.rules.base import Rule

GROUP = "auditor.rules"

# Used only when the package metadata is missing (running from a source tree without installing).
_BUILTIN_FALLBACK = (
    "auditor.rules.anomaly_mode:AnomalyMode",
    "auditor.rules.retained_graph:RetainedGraph",
    "auditor.rules.graph_leak:GraphLeak",
    "auditor.rules.host_sync:HostSync",
    "auditor.rules.peak_stats_reset:PeakStatsReset",
    "auditor.rules.forced_cleanup:ForcedCleanup",
    "auditor.rules.dataloader_bound:DataloaderBound",
    "auditor.rules.step_slowdown:StepSlowdown",
    "auditor.rules.memory_growth:MemoryGrowth",
    "auditor.rules.allocator_fragmentation:AllocatorFragmentation",
    "auditor.rules.oom_risk:OomRisk",
    "auditor.rules.pageable_copy:PageableCopy",
    "auditor.rules.gpu_idle:GpuIdle",
    "auditor.rules.launch_bound:LaunchBound",
    "auditor.rules.dataloader_on_device:DataloaderOnDevice",
    "auditor.rules.amp_opportunity:AmpOpportunity",
    "auditor.rules.rank_straggler:RankStraggler",
    "auditor.rules.collective_wait:CollectiveWait",
    "auditor.rules.ddp_config:DdpConfig",
    "auditor.rules.data_parallel:DataParallel",
    "auditor.rules.nonfinite:Nonfinite",
    "auditor.rules.grad_explosion:GradExplosion",
    "auditor.rules.lr_schedule:LrSchedule",
    "auditor.rules.amp_unscaled:AmpUnscaled",
    "auditor.rules.checkpoint_health:CheckpointHealth",
)


def _load(spec: str) -> type[Rule]:
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


@lru_cache(maxsize=1)
def all_rules() -> dict[str, type[Rule]]:
    """Rule id -> rule class, in id order."""
    found: dict[str, type[Rule]] = {}
    eps = entry_points(group=GROUP)
    if not any(ep.value.startswith("auditor.") for ep in eps):
        for spec in _BUILTIN_FALLBACK:
            cls = _load(spec)
            found[cls.id] = cls
    for ep in eps:
        cls = ep.load()
        if not (isinstance(cls, type) and issubclass(cls, Rule)):
            raise TypeError(f"entry point {ep.name!r} in {GROUP} is not an auditor Rule: {cls!r}")
        found[cls.id] = cls
    return dict(sorted(found.items()))


@lru_cache(maxsize=1)
def rule_ids() -> frozenset[str]:
    """Every rule id, without importing the rules (config validation needs no more)."""
    eps = entry_points(group=GROUP)
    if not any(ep.value.startswith("auditor.") for ep in eps):
        return frozenset(all_rules())
    return frozenset(ep.name for ep in eps)


def get_rule(rule_id: str) -> type[Rule] | None:
    return all_rules().get(rule_id)
