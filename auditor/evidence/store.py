"""Saving and loading a run directory's evidence, so `audit analyze DIR` re-runs the rules later.

A run directory holds `evidence.json` (the typed Evidence), `records.jsonl` (the raw stream the
child process sent, kept for debugging) and `tb/` (profiler traces as a TensorBoard logdir).

Recording paths in evidence.json are relative to the run directory for files inside it (its own
traces: the directory can be moved or copied and still finds them) and absolute for files outside
it. In memory, after load_run_dir, they are absolute; a relative one is relative to the run
directory (as `audit run` records them), never to the current directory.
"""
from __future__ import annotations

from pathlib import Path

import msgspec

from auditor.evidence.errors import InputError
from auditor.evidence.model import EVIDENCE_VERSION, LOAD_NOTES, Evidence, decode, encode
from auditor.evidence.whole_files import write_whole

EVIDENCE_FILE = "evidence.json"


def save(evidence: Evidence, run_dir: Path) -> Path:
    """Write `evidence` as `run_dir` will be read back: see _as_stored (the object is not changed,
    since reports rendered after saving show its absolute paths and this render's notes)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / EVIDENCE_FILE
    write_whole(path, encode(_as_stored(evidence, run_dir)))
    return path


def _as_stored(evidence: Evidence, run_dir: Path) -> Evidence:
    """A copy with recording paths as evidence.json keeps them (the module docstring), and without
    the notes loading added (model.add_load_note): the next load adds them again, so saved they
    would pile up on every re-render."""
    derived = set(evidence.__dict__.get(LOAD_NOTES, ()))
    notes = [n for n in dict.fromkeys(evidence.environment.notes) if n not in derived]
    profile = evidence.profile
    if profile is not None:
        profile = msgspec.structs.replace(profile, trace_files=_stored_paths(profile.trace_files, run_dir))
    return msgspec.structs.replace(
        evidence, environment=msgspec.structs.replace(evidence.environment, notes=notes), profile=profile,
        traces=_stored_paths(evidence.traces, run_dir), snapshots=_stored_paths(evidence.snapshots, run_dir))


def _stored_paths(paths: list[str], run_dir: Path) -> list[str]:
    """Absolute paths to files under `run_dir` made relative to it; the rest kept as they are."""
    base = run_dir.resolve()
    out = []
    for p in paths:
        try:
            out.append(Path(p).resolve().relative_to(base).as_posix() if Path(p).is_absolute() else p)
        except ValueError:  # outside the run directory
            out.append(p)
    return out


def _loaded_paths(paths: list[str], run_dir: Path) -> list[str]:
    """Paths relative to `run_dir` made absolute, so they still name the file wherever the
    evidence goes next (another --out directory, the reports)."""
    return [p if Path(p).is_absolute() else str((run_dir / p).resolve()) for p in paths]


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and (path / EVIDENCE_FILE).is_file()


def load_run_dir(run_dir: Path) -> Evidence:
    """The evidence of a saved run, its recording paths absolute (the module docstring). A note
    an evidence.json holds twice is said once."""
    path = run_dir / EVIDENCE_FILE
    try:
        evidence = decode(path.read_bytes())
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
        raise InputError(f"{path}: not a readable auditor evidence file ({e})") from None
    if evidence.version > EVIDENCE_VERSION or evidence.version < 1:
        # (read, a later format's fields would be dropped and an empty report written over the run's)
        raise InputError(f"{path}: evidence version {evidence.version}, which this auditor (version "
                         f"{EVIDENCE_VERSION}) does not read; an auditor of that version renders it")
    evidence.traces = _loaded_paths(evidence.traces, run_dir)
    evidence.snapshots = _loaded_paths(evidence.snapshots, run_dir)
    if evidence.profile is not None:
        evidence.profile.trace_files = _loaded_paths(evidence.profile.trace_files, run_dir)
    _refuse_outside(evidence, run_dir)
    evidence.environment.notes = list(dict.fromkeys(evidence.environment.notes))
    return evidence


def _refuse_outside(evidence: Evidence, run_dir: Path) -> None:
    """A run's recordings are its own, in its directory: an evidence.json that names one outside
    (a forged directory making the audit read another file of this machine) is refused. The
    evidence of recordings (`audit analyze TRACE --out DIR`) names its inputs where they were: read
    only under the source roots (the current directory, --source-root: auditor.evidence.source_access)."""
    from auditor.evidence import source_access

    base = run_dir.resolve()
    for p in [*evidence.traces, *evidence.snapshots, *(evidence.profile.trace_files if evidence.profile else [])]:
        real = Path(p).resolve()
        if real.is_relative_to(base) or (evidence.source != "run" and source_access.under_roots(real)):
            continue
        raise InputError(f"{run_dir / EVIDENCE_FILE}: names a recording outside its directory ({p}); "
                         "a run directory's recordings are its own: refused")
