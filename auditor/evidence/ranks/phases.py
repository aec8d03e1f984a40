"""The phases a rank's step time is split into: the run's phases (auditor.evidence.phases) with
communication taken out of them into its own (COMM), their labels, and the probe tallies that
name where each phase's time was spent."""
from __future__ import annotations

from auditor.evidence import model as m
from auditor.evidence.phases import PHASES

COMM = "comm"
RANK_PHASES = (*PHASES, COMM)
PHASE_LABELS = {"data": "data loading", "forward": "forward", "backward": "backward", "optimizer": "optimizer step",
                "sync": "host syncs", "cleanup": "gc / empty_cache", "other": "other step code",
                COMM: "communication"}
PHASE_KINDS = {m.DATA_WAIT: "data", m.DATA_ITER: "data", m.FORWARD: "forward", m.BACKWARD: "backward",
               m.OPTIMIZER: "optimizer", m.SYNC: "sync"}
