"""Turn the paths given to `audit analyze` into one Evidence.

Accepted: an `audit run` output directory (its evidence.json, then the traces it lists), a
profiler trace file (`.json` / `.json.gz`), a TensorBoard profiler logdir (any directory holding
`*.pt.trace.json[.gz]`, e.g. `tb/<run>/<worker>.<ts>.pt.trace.json`), and a CUDA memory snapshot
pickle. Several paths merge into one Evidence, so a run and an extra trace are audited together.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from auditor.evidence import store
from auditor.evidence.errors import InputError
from auditor.evidence.model import Evidence, add_load_note
from auditor.evidence.ranks.engines import EngineSpec
from auditor.evidence.ranks.job import is_rank_job, merge_rank_traces
from auditor.evidence.ranks.merge import find_rank_dirs, load_rank_dirs
from auditor.evidence.ranks.traces import merge_traces
from auditor.evidence.snapshot import load_snapshot
from auditor.evidence.trace.load import load_trace
from auditor.evidence.trace.model import Trace

TRACE_SUFFIXES = (".json", ".json.gz")
SNAPSHOT_SUFFIXES = (".pickle", ".pkl")


def _is_trace_file(path: Path) -> bool:
    return path.name.endswith(TRACE_SUFFIXES)


def _is_snapshot_file(path: Path) -> bool:
    return path.suffix in SNAPSHOT_SUFFIXES


def find_traces(directory: Path) -> list[Path]:
    """Profiler traces under a TensorBoard logdir, in a stable order. A directory linked into it is
    not searched (a link to another user's /proc/PID/cwd, or to `/`, would take the walk anywhere);
    one that cannot be read is passed over."""
    found = []
    for root, _, files in os.walk(directory):
        for name in files:
            if name.endswith((".pt.trace.json", ".pt.trace.json.gz")) and os.path.isfile(os.path.join(root, name)):
                found.append(Path(root, name))
    return sorted(found)


def name_by_logdir(traces: list[Any], logdirs: list[Path]) -> None:
    """Label each parsed trace found in a run of one of `logdirs` by its path there
    (`run-a/host.pt.trace.json`): a logdir's runs often share file names, and messages about two
    runs must tell them apart. Traces at a logdir's top keep their file name."""
    for trace in traces:
        for logdir in logdirs:
            try:
                rel = Path(trace.path).relative_to(logdir)
            except ValueError:
                continue
            if len(rel.parts) >= 2:
                trace.label = rel.as_posix()
                break


def _logdirs(paths: list[Path]) -> list[Path]:
    """The inputs that are TensorBoard logdirs: directories other than `audit run` output (whose
    traces are its own, one run)."""
    return [p for p in paths if p.is_dir() and not store.is_run_dir(p)]


def load_paths(paths: list[Path], engine: Any = None, on_rank: Any = None) -> Evidence:
    """One Evidence from every input path, with parsed traces and snapshots attached.

    `engine` (an auditor.evidence.ranks.engines.EngineSpec; None: the default, `local`) is where
    the traces of a job's ranks are reduced, `on_rank` called in this process as each is done.

    Parsed traces go to `evidence.trace_data`, parsed snapshots to `evidence.snapshot_data`
    (runtime attributes; `traces` / `snapshots` keep the paths). Raises InputError for a path that
    does not exist or that is none of the accepted kinds.
    """
    if not paths:
        raise InputError("nothing to analyze: give a run directory, a trace or a snapshot")
    merged, read = merge_inputs([Path(p) for p in paths], engine, on_rank)  # several ranks of one distributed run
    if merged is not None:  # (trace_data / snapshot_data already attached)
        merged.target = merged.target or " ".join(str(p) for p in paths)
        merged.traces, merged.snapshots = _absolute(merged.traces), _absolute(merged.snapshots)
        name_by_logdir(merged.trace_data, _logdirs([Path(p) for p in paths]))
        note_traces(merged, merged.trace_data, dropped=False)  # (every rank's dropped events: said in the merge)
        if merged.source != "run":
            _environment_from_traces(merged)
        return merged
    evidence, listed, found, trace_paths, snapshot_paths = _sort_inputs(paths)
    if evidence is None:
        evidence = Evidence(source="trace" if trace_paths else "snapshot",
                            target=" ".join(str(p) for p in paths))
        evidence.traces = _absolute(trace_paths)
        evidence.snapshots = _absolute(snapshot_paths)
    else:
        known_t = set(evidence.traces)
        evidence.traces = evidence.traces + [p for p in _absolute(trace_paths) if p not in known_t]
        known_s = set(evidence.snapshots)
        evidence.snapshots = evidence.snapshots + [p for p in _absolute(snapshot_paths) if p not in known_s]
    parsed = _parse_traces(evidence, trace_paths, listed, found, read)
    unread = evidence.__dict__.get(UNREAD_TRACES, [])
    if unread and not parsed and not snapshot_paths:
        raise InputError(unread[0][1] if len(unread) == 1 else
                         f"none of the {len(unread)} traces could be read (the first: {unread[0][1]})")
    name_by_logdir(parsed, _logdirs([Path(p) for p in paths]))
    note_traces(evidence, parsed)
    snapshots = [load_snapshot(p) for p in dict.fromkeys(snapshot_paths)]
    evidence.__dict__["trace_data"] = parsed
    evidence.__dict__["snapshot_data"] = snapshots
    for snap in snapshots:  # (sizes no device has, left out: auditor.evidence.snapshot.MAX_BYTES)
        if getattr(snap, "dropped", ""):
            add_load_note(evidence, f"{Path(snap.path).name}: {snap.dropped}")
    if evidence.source != "run":
        _environment_from_traces(evidence)
    return evidence


def _sort_inputs(paths: list[Path]) -> tuple[Evidence | None, set[Path], set[Path], list[Path], list[Path]]:
    """The inputs by kind: the one run directory's evidence (or None), the traces it lists, those
    found in directories given, and every trace and snapshot path. InputError for any other path."""
    evidence: Evidence | None = None
    listed: set[Path] = set()  # traces a run directory lists: a crashed run may not have written them
    found: set[Path] = set()  # traces found in a directory given: one unreadable is skipped, and named
    trace_paths: list[Path] = []
    snapshot_paths: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise InputError(f"{path}: no such file or directory")
        if store.is_run_dir(path):
            run = store.load_run_dir(path)
            if evidence is None:
                evidence = run
            else:
                raise InputError(f"{path}: only one `audit run` directory can be analyzed at a time")
            trace_paths.extend(Path(t) for t in run.traces)
            listed.update(Path(t) for t in run.traces)
            snapshot_paths.extend(Path(s) for s in run.snapshots)
        elif path.is_dir():
            traces = find_traces(path)
            if not traces:
                raise InputError(f"{path}: not an audit run directory and holds no *.pt.trace.json[.gz] "
                                 f"profiler traces")
            trace_paths.extend(traces)
            found.update(traces)
        elif _is_trace_file(path):
            trace_paths.append(path)
        elif _is_snapshot_file(path):
            snapshot_paths.append(path)
        else:
            raise InputError(f"{path}: unsupported input (expected an audit run directory, a profiler "
                             f"trace .json/.json.gz, a TensorBoard logdir or a memory snapshot .pickle)")
    return evidence, listed, found, trace_paths, snapshot_paths


def _parse_traces(evidence: Evidence, trace_paths: list[Path], listed: set[Path], found: set[Path],
                  read: dict[Path, Trace | InputError]) -> list[Trace]:
    """Each trace parsed once; one a run lists but lost, or one of a directory's that cannot be read,
    is noted in `evidence` and skipped."""
    seen: set[Path] = set()
    parsed = []
    for p in trace_paths:
        key = p.resolve()
        if key in seen:
            continue
        seen.add(key)
        if not p.exists() and p in listed:
            gz = p.with_name(p.name + ".gz")  # a listed trace compressed since (to share the run)
            if not gz.exists():
                add_load_note(evidence, f"profiler trace {p} listed by the run is missing")
                continue
            p = gz
        try:
            got = read.pop(key, None)
            if isinstance(got, InputError):  # (merge_inputs read it already)
                raise got
            parsed.append(got or load_trace(p))
        except InputError as e:
            if p in found:  # one of a directory's traces: the others are analysed, this one named
                skip_unread(evidence, p, str(e))
                continue
            if p not in listed:  # a trace given to analyze: that input is unusable
                raise
            # a run's own trace, damaged (the disk filled, the run was killed while it was written):
            # the run's other evidence still holds, as it does when the trace is missing
            add_load_note(evidence, f"profiler trace not analysed: {e}")
    return parsed


# Evidence.__dict__ key: [(path, why)] of the traces found in a directory that could not be read
# (skipped, the others analysed; `audit analyze` names them on stderr, a load note in the report)
UNREAD_TRACES = "unread_traces"


def skip_unread(evidence: Evidence, path: Path, why: str) -> None:
    evidence.__dict__.setdefault(UNREAD_TRACES, []).append((str(path), why))
    add_load_note(evidence, f"not read, left out: {why}")


def merge_inputs(paths: list[Path], engine: Any = None,
                 on_rank: Any = None) -> tuple[Evidence | None, dict[Path, Trace | InputError]]:
    """For `load_paths`: the merged Evidence when `paths` are the ranks of one job, else None; and
    the traces parsed to find out, by resolved path, so that none is parsed twice.

    Recognised: a directory of `rank-K/` run directories (without its own evidence.json), several
    rank run directories, and profiler traces (files or directories of them) naming at least two
    different ranks in `distributedInfo`. The Evidence carries parsed traces of the primary rank in
    `trace_data`, as load_paths would attach them. Traces whose headers name the ranks are each
    reduced to a summary on `engine` (auditor.evidence.ranks.job), so that no more than the
    summaries and the primary rank's trace are ever held here.

    Raises InputError when several run directories are not the ranks of one job (check_one_job).
    """
    run_dirs: list[Path] = []
    parents = others = 0
    for p in paths:
        if store.is_run_dir(p):
            run_dirs.append(p)
        elif sub := find_rank_dirs(p):
            run_dirs.extend(sub)
            parents += 1
        else:
            others += 1
    if run_dirs:
        if others or (len(run_dirs) == 1 and not parents):
            return None, {}  # one plain run, or runs mixed with other inputs: the ordinary path
        merged = load_rank_dirs(run_dirs, engine=engine, on_done=on_rank)
        return _attach_traces(merged, [Path(t) for t in merged.traces], getattr(engine, "sketch", False)), {}
    files: list[Path] = []
    found: set[Path] = set()
    for p in paths:
        if p.is_dir():
            files.extend(find_traces(p))
            found.update(find_traces(p))
        elif _is_trace_file(p):
            files.append(p)
        else:
            return None, {}
    if len(files) < 2:
        return None, {}
    if is_rank_job(files):
        return merge_rank_traces(files, engine or EngineSpec(), on_rank), {}
    failed: dict[Path, InputError] = {}
    merged, held = merge_traces(_parse_each(files, found, failed))
    if merged is not None:
        for f, e in failed.items():
            skip_unread(merged, f, str(e))
        return merged, {}
    return None, {**{f.resolve(): e for f, e in failed.items()}, **{Path(t.path).resolve(): t for t in held}}


def _parse_each(files: list[Path], found: set[Path], failed: dict[Path, InputError]) -> Iterator[Trace]:
    """Each trace parsed; one found in a directory that cannot be read is left in `failed`."""
    for f in files:
        try:
            yield load_trace(f)
        except InputError as e:
            if f not in found:
                raise
            failed[f] = e


def _attach_traces(ev: Evidence, paths: list[Path], sketch: bool = False) -> Evidence:
    """The merged evidence of rank run directories with the primary rank's traces attached: parsed,
    or with `sketch` as their sketches, made in a process of their own (auditor.evidence.ranks.sketch;
    the rules then run where they are parsed again, as for a job's traces)."""
    parsed: list[Any] = []
    present = [p for p in paths if p.is_file()]
    for p in paths:
        if p not in present:
            add_load_note(ev, f"profiler trace {p} listed by the run is missing")  # (as load_paths says it)
    if sketch and present:
        from auditor.evidence.ranks.engines import in_child
        from auditor.evidence.ranks.job import sketch_files
        from auditor.evidence.ranks.sketch import sketched

        for kept in in_child(sketch_files, [str(p) for p in present]):
            if isinstance(kept, str):
                raise InputError(kept)
            parsed.append(sketched(kept))
    else:
        parsed = [load_trace(p) for p in present]
    ev.__dict__["trace_data"] = parsed
    ev.__dict__["snapshot_data"] = []
    return ev


def note_traces(evidence: Evidence, traces: list[Any], dropped: bool = True) -> None:
    """What the reports must say about how parsed traces were read: events left out for fields of
    the wrong type, and steps taken from the optimizer for lack of ProfilerSteps."""
    for trace in traces:
        if dropped and trace.dropped:
            add_load_note(evidence, f"{trace.label}: {trace.dropped}")
        if trace.steps_from:
            add_load_note(evidence, f"{trace.label} has no ProfilerStep ranges (recorded without a schedule): its "
                                    f"{len(trace.steps)} steps {trace.steps_from}; what came before the first is left out")


def _absolute(paths: list[Path] | list[str]) -> list[str]:
    """Recording paths as the evidence keeps them: absolute, since an input named relative to the
    current directory is read back (`audit report`) from the output directory, against which the
    saved evidence's relative paths are resolved. Symbolic links are kept as the user named them
    (os.path.abspath, not resolve): the path the user gave is the one they recognise."""
    return [os.path.abspath(p) for p in paths]


def _environment_from_traces(evidence: Evidence) -> None:
    """Recordings say where they ran (Kineto's deviceProperties), and this machine, which only
    analyses them, has nothing to say about it: the device comes from the first trace that names
    its GPUs, torch's version from the first that states it (torch writes none itself: left empty
    then, not this machine's). (`cuda_devices` stays a run's own report: oom-risk reads trace
    capacities itself, and says where each came from.)"""
    traces = evidence.__dict__.get("trace_data") or ()
    evidence.environment.torch_version = next((v for t in traces if (v := t.torch_version)), "")
    for trace in traces:
        props = trace.metadata.get("deviceProperties")
        names = sorted({str(p.get("name", "")) for p in props if isinstance(p, dict)}) if isinstance(props, list) else []
        if not names:
            continue
        env = evidence.environment
        env.device, env.cuda_available = "cuda", True
        add_load_note(evidence, f"device as recorded in {trace.label}: {', '.join(names)}")
        return
