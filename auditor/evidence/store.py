"""Saving and loading a run directory's evidence, so `audit analyze DIR` re-runs the rules later.

A run directory holds `evidence.json` (the typed Evidence), `records.jsonl` (the raw stream the
child process sent, kept for debugging) and `tb/` (profiler traces as a TensorBoard logdir).
"""
from __future__ import annotations

from pathlib import Path

import msgspec

from auditor.evidence.errors import InputError
from auditor.evidence.model import Evidence, decode, encode

EVIDENCE_FILE = "evidence.json"


def save(evidence: Evidence, run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / EVIDENCE_FILE
    path.write_bytes(encode(evidence))
    return path


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and (path / EVIDENCE_FILE).is_file()


def load_run_dir(run_dir: Path) -> Evidence:
    """The evidence of a saved run; trace paths in it are made absolute against `run_dir`."""
    path = run_dir / EVIDENCE_FILE
    try:
        evidence = decode(path.read_bytes())
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
        raise InputError(f"{path}: not a readable auditor evidence file ({e})") from None
    evidence.traces = [str((run_dir / t).resolve()) if not Path(t).is_absolute() else t for t in evidence.traces]
    evidence.snapshots = [str((run_dir / s).resolve()) if not Path(s).is_absolute() else s
                          for s in evidence.snapshots]
    return evidence
