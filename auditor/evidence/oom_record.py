"""The file format of the out-of-memory observer's record (written by auditor.capture.cuda_memory,
read by auditor.evidence.snapshot as Snapshot.oom): a JSON object beside the OOM snapshot, at the
snapshot's name with `.json` (oom_record_path), with the keys
  kind: OOM_RECORD_KIND, which marks the JSON as the auditor's (a stray foo.json is ignored)
  device, requested, device_total, device_free: the observer's arguments (ints, bytes)
  time_us: wall clock, microseconds since the epoch
  ooms: how many OOMs the observer had seen in the run, this one included
  snapshot: the snapshot's file name; observer_args: the observer's four arguments as given
  frames: the Python stack of the failing allocation, innermost first (at most MAX_OOM_FRAMES)
"""
from __future__ import annotations

import os
from pathlib import Path

OOM_RECORD_KIND = "auditor-cuda-oom-observer"
# How many Python frames of the failing allocation the OOM record keeps (innermost first).
MAX_OOM_FRAMES = 64


def oom_record_path(snapshot_path: str | os.PathLike[str]) -> Path:
    """Where the OOM observer's record of a snapshot is: the same name with `.json`."""
    return Path(snapshot_path).with_suffix(".json")

# The snapshot a CUDA rehearsal with --device-memory writes at the first step whose requests outgrow
# the rehearsed device (auditor.capture.rehearsal.memory): a forecast, not a recording.
REHEARSAL_FORECAST = "rehearsal_oom_snapshot.pickle"
