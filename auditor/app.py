"""The `audit` pipelines behind the command line: run, analyze, report and checkpoint, and their exit codes.

Each pipeline returns the exit code, a contract documented in the README and in auditor.errors,
which defines the codes. A usage error is raised as UsageFailure, an auditor.AuditError
(auditor.cli prints it as one line and exits 2; auditor.api lets it reach the caller).

Every pipeline ends the same way (`finish`): save the evidence, then load -> rules -> reports, the
path `audit analyze DIR` takes.
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import click

from auditor.command_options import AnalyzeOptions, CheckpointOptions, RunOptions
from auditor.config import Config, ConfigError, load_config
from auditor.errors import EXIT_FAIL_ON, EXIT_INTERNAL, EXIT_OK, EXIT_TARGET_FAILED, EXIT_USAGE, UsageFailure
from auditor.evidence.errors import InputError
from auditor.findings import severity_rank

if TYPE_CHECKING:
    from auditor.capture.target import Target


# --- output directories --------------------------------------------------------------------------

def _default_out(name: str) -> Path:
    """audit-out/<name>-<timestamp>, the name cut to 100 characters: a file name may be 255 bytes
    long, and `checkpoint-<a 240-character file name>-<timestamp>` could not be made."""
    return Path("audit-out") / f"{name[:100]}-{time.strftime('%Y%m%d-%H%M%S')}"


def _claim_default(name: str) -> Path:
    """The default output directory, made by this call (os.mkdir: never one another audit made):
    a second audit of the same target started in the same second gets `<name>-<timestamp>-2`."""
    base = _default_out(name)
    base.parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        out = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            out.mkdir()
        except FileExistsError:
            continue
        _MADE.add(out)
        return out
    raise FileExistsError(errno.EEXIST, "a thousand audits of it started in this second", str(base))


_MADE: set[Path] = set()  # output directories this command created (see output_dir, drop_if_unused)


def out_option(value: str | None) -> Path | None:
    """--out as given: an empty path (it would be the current directory) and a path with a control
    character (a newline: the profiler cannot write its trace there) are refused."""
    if value is None:
        return None
    if not value:
        raise UsageFailure("--out: an empty path (for the current directory, say --out .)")
    if any(not c.isprintable() for c in value):
        raise UsageFailure(f"--out {value!r}: holds a control character (a newline?); choose another directory")
    return Path(value)


def output_dir(out_dir: Path | None, name: str) -> Path:
    """The output directory (--out, or the default for `name`), created now: a path that cannot
    be written is the user's to fix (exit 2), found before anything runs, and so is a symbolic
    link at a name the audit writes there (refuse_planted). An earlier audit's outputs there are
    replaced, and a line on stderr says so."""
    if out_dir is not None and out_dir.exists() and not out_dir.is_dir():
        raise UsageFailure(f"--out {out_dir}: not a directory")
    out = out_dir
    try:
        if out is None:
            out = _claim_default(name)
        elif not out.exists():
            with contextlib.suppress(FileExistsError):
                out.mkdir(parents=True)
                _MADE.add(out)
        write_probe(out)
    except OSError as e:
        raise UsageFailure(f"--out {out or _default_out(name)}: cannot write there ({e.strerror or e})") from None
    refuse_planted(out)
    _lock(out)
    if (out / "evidence.json").is_file() or (out / "report.html").is_file():
        click.echo(f"audit: --out {out} holds an earlier audit's outputs: this audit replaces them", err=True)
    return out


def own_names(reports: bool = False) -> list[str]:
    """The names the audit writes in an output directory (`reports`: those `audit report` writes)."""
    from auditor.reports import all_reporters

    written = ["evidence.json", "verified.json", *(r.filename for r in all_reporters())]
    return written if reports else [LOCK_FILE, "records.jsonl", "tb", "memory_snapshot.pickle", "verify-table.json",
                                    "diff.json", "diff.html", *written]


def refuse_planted(out: Path, named: str = "--out ", reports: bool = False) -> None:
    """A symbolic link at a name the audit writes in `out` is refused (exit 2), before anything
    runs: in a shared directory another user's link would make the audit write where it points.
    (Each write refuses one made later too: auditor.evidence.whole_files.)"""
    for name in own_names(reports):
        path = out / name
        if path.is_symlink():
            raise UsageFailure(f"{named}{out}: {name} there is a symbolic link (to {os.readlink(path)}); the audit "
                               "never writes through one: remove it or choose another directory")


LOCK_FILE = ".audit-lock"
_LOCKS: dict[Path, int] = {}  # the output directories this process has locked: their lock files' descriptors


def _lock(out: Path) -> None:
    """One audit at a time writes into a directory: a second one started while the first still runs
    is refused (exit 2) instead of the two overwriting each other's files. The lock is the kernel's
    (flock), so it goes with the process however that ends; the lock file is removed at exit."""
    try:
        import fcntl
    except ImportError:  # (no flock on this platform: unlocked, as before)
        return
    from auditor.evidence.whole_files import open_kept

    if out in _LOCKS:  # (this process holds it already: a command run twice in one process)
        return
    try:
        fd = open_kept(out / LOCK_FILE)
    except OSError as e:
        raise UsageFailure(f"--out {out}: cannot lock it ({e}); remove {out / LOCK_FILE} or choose "
                           "another directory") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise UsageFailure(f"--out {out}: another audit is writing there now (pid {holder}); wait for it or "
                           "choose another directory") from None
    with contextlib.suppress(OSError):  # (the holder's pid is for the message above; a full disk has no room for it)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
    if not _LOCKS:
        atexit.register(_release_all)
    _LOCKS[out] = fd


def _release(out: Path) -> None:
    fd = _LOCKS.pop(out, None)
    if fd is not None:
        with contextlib.suppress(OSError):
            (out / LOCK_FILE).unlink()
        os.close(fd)


def release(out: Path) -> None:
    """`out`'s lock released now, not at exit: the Python API's audits end before its process does."""
    _release(out)


def _release_all() -> None:
    for out in list(_LOCKS):
        _release(out)


def write_probe(directory: Path) -> None:
    """Raises OSError when a file cannot be created in `directory`."""
    from auditor.evidence.whole_files import probe_writable

    probe_writable(directory)


def drop_if_unused(out: Path) -> None:
    """A run that never started (a usage error) leaves no output directory it made itself."""
    _release(out)
    if out in _MADE:
        try:
            out.rmdir()  # (only if empty)
        except OSError:
            pass


def rule_config(start: Path, select: tuple[str, ...], ignore: tuple[str, ...]) -> Config:
    """The [tool.auditor] config found from `start`, with --select/--ignore applied."""
    try:
        return load_config(start, select, ignore)
    except ConfigError as e:
        raise UsageFailure(str(e)) from None


# --- the end every pipeline shares ---------------------------------------------------------------

def exit_code(evidence, results, fail_on: str | None) -> int:
    from auditor.evidence.model import ended_well

    if evidence.source == "run" and not ended_well(evidence.ending):
        return EXIT_INTERNAL if evidence.ending.audit_cause else EXIT_TARGET_FAILED
    if fail_on and any(severity_rank(f.severity) >= severity_rank(fail_on) for f in results.findings):
        return EXIT_FAIL_ON
    return EXIT_OK


def finish(evidence, config: Config, out: Path, quiet: bool, fail_on: str | None,
           baseline: tuple | None = None, amend=None, verbose: bool = False) -> int:
    """Save the evidence, then load -> rules -> reports: the same path `audit analyze DIR` takes.
    `baseline` (--baseline: its loaded Evidence and its path) adds the comparison with it to the
    reports, and its summary after the findings. `amend(evidence, results)`, when given, returns
    the results the reports render (--verify's)."""
    from auditor.evidence.load import load_paths
    from auditor.evidence.model import add_load_note
    from auditor.evidence.store import is_run_dir
    from auditor.reports import write_reports
    from auditor.reports.sources import as_recorded, differences, record_quoted
    from auditor.reports.terminal import print_summary
    from auditor.rules.engine import run_rules

    # outputs not written (a full disk): named on the terminal, exit 2 (the run's records and
    # profiler trace: auditor.capture.runner)
    lost: list[str] = list(evidence.__dict__.get("unwritten", ()))
    earlier = earlier_traces(out)
    saved = _saved(evidence, out, lost)
    if saved:
        drop_earlier(out, earlier, evidence)
    if saved and evidence.source == "run" and is_run_dir(out):
        try:
            evidence = load_paths([out])  # attaches the profiled window's parsed trace
        except InputError as e:
            add_load_note(evidence, f"profiler trace not analysed: {e}")
    results = run_rules(evidence, config)
    if amend is not None:
        results = amend(evidence, results)
    # the sources quoted, as first read: recorded (and saved) on the first render; a later render
    # of a changed file quotes them and says so (auditor.reports.sources)
    if record_quoted(evidence, results) and not lost:
        _saved(evidence, out, lost)
    results = as_recorded(evidence, results)
    comparison = compare_with_baseline(evidence, results, baseline[0], str(baseline[1]), config) if baseline else None
    written = write_reports(out, evidence, results)
    unwritten = lost + _unwritten(written)
    if quiet:
        ran = f", run {evidence.ending.status}" if evidence.source == "run" else ""  # (recordings: nothing ran)
        where = f"report in {out}" if "report.html" not in unwritten else f"report not written, outputs in {out}"
        click.echo(f"audit: {len(results.findings)} finding(s){ran}; {where}")
        if unwritten:
            click.echo(f"audit: not written (see the warnings above): {', '.join(unwritten)}")
    elif not unwritten:
        print_summary(evidence, results, out, verbose=verbose)
    else:  # the summary names the outputs found in `out`: an older one there is not this run's
        print_summary(evidence, results, None, verbose=verbose)
        _echo_written(out, written, unwritten)
    if comparison is not None:
        from auditor.reports.diff_report import headline, print_diff

        if quiet:
            click.echo(f"audit: against baseline {baseline[1]}: {headline(comparison)}")
        else:
            print_diff(comparison, title=f"compared with baseline {baseline[1]}:")
    for line in differences(evidence, results):
        click.echo(line)
    code = exit_code(evidence, results, fail_on or config.fail_on)
    # an output not written is the environment's to fix (a full disk, a quota): exit 2, unless the
    # audited program failed (exit 3 says that first; the lines above name what was not written)
    return EXIT_USAGE if unwritten and code != EXIT_TARGET_FAILED else code


def _saved(evidence, out: Path, lost: list[str]) -> bool:
    """evidence.json written (whole, or the earlier one left as it was); False, with a warning and
    its name in `lost`, when it could not be."""
    from auditor.evidence.store import EVIDENCE_FILE, save

    try:
        save(evidence, out)
    except OSError as e:
        if os.environ.get("AUDIT_DEBUG"):
            raise
        click.echo(f"audit: warning: could not write {EVIDENCE_FILE}: {e.strerror or e}", err=True)
        if EVIDENCE_FILE not in lost:
            lost.append(EVIDENCE_FILE)
        return False
    return True


def earlier_traces(out: Path) -> list[Path]:
    """The profiler traces an earlier audit's evidence.json in `out` names under `out/tb` (the ones
    it wrote there), as they are now."""
    import json

    from auditor.evidence.store import EVIDENCE_FILE

    try:
        doc = json.loads((out / EVIDENCE_FILE).read_bytes())
    except (OSError, ValueError):
        return []
    profile = doc.get("profile") if isinstance(doc, dict) else None
    named = [*(doc.get("traces") or []), *((profile or {}).get("trace_files") or [])] if isinstance(doc, dict) else []
    tb = (out / "tb").resolve()
    found = []
    for name in named:
        if not isinstance(name, str) or not name:
            continue
        path = Path(name) if Path(name).is_absolute() else out / name
        if path.parent.resolve().is_relative_to(tb) and path.is_file() and not path.is_symlink():
            found.append(path.parent.resolve() / path.name)
    return list(dict.fromkeys(found))


def drop_earlier(out: Path, earlier: list[Path], evidence) -> None:
    """Once this audit's evidence.json has replaced an earlier one, the traces only that one named
    (earlier_traces) go with it: TensorBoard would show them as this run's. Nothing else in `out`
    is removed (a user's own traces in ./tb with `--out .` are theirs)."""
    kept = {(p if p.is_absolute() else out / p).parent.resolve() / p.name
            for p in map(Path, [*evidence.traces, *(evidence.profile.trace_files if evidence.profile else [])])}
    for path in earlier:
        if path not in kept:
            with contextlib.suppress(OSError):
                path.unlink()


def _unwritten(written: dict[str, Path]) -> list[str]:
    """The output files a reporter failed to write (write_reports warned about each)."""
    from auditor.reports import all_reporters

    return [r.filename for r in all_reporters() if r.name not in written]


def _echo_written(out: Path, written: dict[str, Path], unwritten: list[str]) -> None:
    """The summary's closing lines when some outputs could not be written: which were, which
    were not."""
    from auditor.reports.terminal import OUTPUTS

    report = written.get("html")
    click.echo(f"report: {report if report else 'not written'}")
    others = [str(out / n) for n in OUTPUTS  # (as the summary names them: empty patches left out)
              if n != "report.html" and n not in unwritten and (out / n).is_file() and (out / n).stat().st_size]
    if others:
        click.echo("also: " + ", ".join(others))
    click.echo(f"not written (see the warnings above): {', '.join(unwritten)}")


def prewarm_report() -> None:
    """Import what the report path needs (rules, the trace loader and pandas, plotly and its
    template, the compiled page template) while the child imports torch and runs the steps, so
    the user waits for none of it after the last step."""
    import threading

    def prewarm() -> None:
        import importlib

        from auditor.reports import html

        importlib.import_module("auditor.evidence.load")  # pandas, numpy
        from auditor.rules.registry import all_rules

        all_rules()
        html.prewarm()

    threading.Thread(target=prewarm, daemon=True).start()


def afterwards(out: Path, open_report: bool, tensorboard: bool) -> None:
    """--open and --tensorboard: show the user what was written."""
    if open_report and (out / "report.html").is_file():
        import webbrowser

        webbrowser.open((out / "report.html").resolve().as_uri())
    if tensorboard:
        from auditor.reports.tensorboard import (TensorBoardError, start_tensorboard, stop_tensorboard,
                                                 tensorboard_available)

        why_not = tensorboard_available()
        if why_not:
            click.echo(f"audit: cannot start TensorBoard: {why_not}", err=True)
            return
        try:
            # a launch keeps each rank's logdir under rank-K/tb: TensorBoard finds them all from `out`
            url, proc = start_tensorboard(out / "tb" if (out / "tb").is_dir() else out)
        except TensorBoardError as e:
            click.echo(f"audit: TensorBoard did not start: {str(e).splitlines()[0]}", err=True)
            return
        click.echo(f"TensorBoard: {url}#pytorch_profiler  (Ctrl-C to stop)")
        try:
            # in short waits, not one: a Ctrl-C that lands on another thread of this process must
            # still reach the main thread, which only checks for it when it runs Python code
            while proc.poll() is None:
                try:
                    proc.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    pass
        except KeyboardInterrupt:
            pass
        finally:
            stop_tensorboard(proc)


# --- the pipelines -------------------------------------------------------------------------------

def run(target: str | None, options: RunOptions, module: str | None = None, args: Sequence[str] = ()) -> int:
    """`audit run`: the target in a child process (or N ranks of it under torch.distributed.run,
    or this process as one rank of a launch: auditor.launch), then finish. The target is a step
    callable, or a whole program (a file, or `module` for -m, `args` its arguments) whose steps
    the child finds."""
    from auditor import launch
    from auditor.evidence.allocator.analysis import given_device_memory

    t, args = run_target(target, module, tuple(args))
    refuse_run(t, options)
    roots = allow_project_sources(t.file)
    device_key = device_option(options.device)
    config = rule_config(Path(t.file).parent if t.file else Path.cwd(), options.select, options.ignore)
    base = (load_baseline(options.baseline), options.baseline) if options.baseline is not None else None
    audit = RunAudit(t, options, args, module, roots, device_key, config, base)
    session = launch.RankSession.from_env(options.out, t.name)
    with given_device_memory(options.device_memory):
        if options.nproc_per_node is not None:
            return audit.launch(session)
        return audit.run_here(session)


def run_target(target: str | None, module: str | None, args: tuple[str, ...]) -> tuple[Target, tuple[str, ...]]:
    """The Target `audit run` names (TARGET, or -m MODULE) and the program's arguments; a torch
    too old or a TARGET that is not one is a usage error."""
    from auditor.capture.target import TargetError, module_target, parse_target
    from auditor.capture.torch_private import installed_version, unsupported

    too_old = unsupported(installed_version())
    if too_old is not None:
        raise UsageFailure(too_old)
    try:
        if module is not None:  # (`-m pkg.mod -- ARGS`: click gives the first of ARGS as TARGET)
            return module_target(module), ((target,) if target is not None else ()) + args
        if target is None:
            raise TargetError("missing TARGET (path/to/file.py, path/to/file.py:callable, package.module:callable) "
                              "or -m package.module")
        return parse_target(target), args
    except TargetError as e:
        raise UsageFailure(str(e)) from None


def refuse_run(t: Target, options: RunOptions) -> None:
    """The options that do not apply to this target, or to this process, as a usage error."""
    if options.verify and (options.nproc_per_node is not None or os.environ.get("RANK") is not None):
        raise UsageFailure("--verify re-runs a single process; it does not apply to a distributed launch")
    if (options.skip or options.to_end) and not t.is_program:
        raise UsageFailure("--skip and --to-end apply to a whole program (path/to/file.py or -m package.module), "
                           "not to a step callable")


@dataclass
class RunAudit:
    """One `audit run`, as its pipeline reads it: the target, its options and arguments (`module`:
    -m's), the project's source roots, the device model's key, the rules' config and the baseline."""

    target: Target
    options: RunOptions
    args: tuple[str, ...]
    module: str | None
    roots: list[str]
    device_key: str
    config: Config
    baseline: tuple | None

    def finish(self, evidence, out: Path, amend=None) -> int:
        o = self.options
        return finish(with_device(evidence, self.device_key), self.config, out, o.quiet, o.fail_on, self.baseline,
                      amend, verbose=o.verbose)

    def launch(self, session) -> int:
        """--nproc-per-node N: the ranks under torch.distributed.run, their merged evidence reported here."""
        from auditor import launch
        from auditor.capture.target import TargetError, check_statically

        if session is not None:
            raise UsageFailure("--nproc-per-node: already running under a launcher (RANK is set)")
        try:
            check_statically(self.target)  # a rank's usage error would reach us only as the launcher's failure
        except TargetError as e:
            raise UsageFailure(str(e)) from None
        o = self.options
        out = output_dir(o.out, self.target.name)
        prewarm_report()
        code = launch.launch(self.target.spec, o.nproc_per_node, out, launch.rank_argv(o, out, self.args),
                             lambda ev: self.finish(with_roots(ev, self.roots), out))
        afterwards(out, o.open_report, o.tensorboard)
        return code

    def run_here(self, session) -> int:
        """The target in one child process: the whole audit, or this rank's part of a launch (`session`)."""
        o = self.options
        out = session.run_dir if session is not None else output_dir(o.out, self.target.name)
        if session is None or session.env.merges():  # (only the merging process writes the report)
            prewarm_report()
        evidence = self.run_child(out, session)
        evidence.source_roots = self.roots
        if session is not None:  # distributed: save this rank; the merging rank reports on every rank
            return session.finish(evidence, o.rank_timeout, self.finish)
        if not o.verify:
            (out / "verified.json").unlink(missing_ok=True)  # (an earlier --verify's, in a reused --out)
            code = self.finish(evidence, out)
        else:
            code = self.verified(evidence, out)
        afterwards(out, o.open_report, o.tensorboard)
        return code

    def run_child(self, out: Path, session):
        """The child's evidence, with a progress bar (rank 0's, under a launch)."""
        from auditor import launch
        from auditor.capture.progress import StepProgress
        from auditor.capture.runner import RunRequest, run_child
        from auditor.capture.target import TargetError

        o = self.options
        shown = not o.quiet and sys.stderr.isatty() and launch.shows_progress(session)
        with StepProgress(o.steps, enabled=shown) as progress, launch.stoppable(session):
            try:
                return run_child(RunRequest(self.target, out, o, script_args=self.args, catch_sigterm=session is None),
                                 on_record=progress.on_record)
            except TargetError as e:
                drop_if_unused(out)
                raise UsageFailure(str(e)) from None

    def verified(self, evidence, out: Path) -> int:
        """--verify: the reports of the audit, each fix verified by re-running it (auditor.verify)."""
        from auditor import verify as v

        spec = v.RunSpec(None if self.module is not None else self.target.spec, self.module, self.args, self.options)
        done: list = []
        code = self.finish(evidence, out, amend=lambda ev, res: v.amend_run(
            ev, res, spec, self.target.file, out, self.options.quiet, done))
        v.echo_done(done)
        return code


def allow_project_sources(target_file: str | None) -> list[str]:
    """`audit run` quotes the audited project's files (auditor.fixes.project_roots: the current
    directory's git toplevel, and the target file's): its source is read under these alone."""
    from auditor.evidence import source_access
    from auditor.fixes import project_roots

    roots = [str(r) for r in project_roots(target_file or "")]
    source_access.allow(roots)
    return list(dict.fromkeys(roots))


def allow_sources(given: tuple[Path, ...], paths: tuple[Path, ...] | list[Path]) -> None:
    """The source roots of a command that reads recordings: the `--source-root` directories, and,
    where a saved run directory is among the inputs, the current directory's project (its git
    toplevel, else the directory: where one re-renders a run of one's project, the root `audit run`
    reads from there). The roots a run directory recorded are never taken: a directory can be
    forged to name any file of this machine; its quoted lines are those it stored (Evidence.sources).
    None given: no source is read."""
    from auditor.evidence import source_access
    from auditor.evidence.store import is_run_dir
    from auditor.fixes import repo_root

    roots = [str(r) for r in given]
    for r in given:
        if not r.is_dir():
            raise UsageFailure(f"--source-root {r}: no such directory")
    if any(is_run_dir(p) for p in paths):
        roots.append(str(repo_root(Path.cwd())))
    source_access.allow(roots)


def device_option(name: str | None) -> str:
    """The device model's key `--device NAME` names ('' when not given); an unknown name is a
    usage error that lists the known ones."""
    from auditor.evidence.devices import find_device, unknown_device_message

    if name is None:
        return ""
    found = find_device(name)
    if found is None:
        raise UsageFailure(unknown_device_message(name))
    return found.key


def with_roots(evidence, roots: list[str]):
    """The evidence with the project's source roots recorded (a launch's merged evidence)."""
    evidence.source_roots = roots
    return evidence


def with_device(evidence, key: str):
    """The evidence with `--device`'s choice recorded in its environment (kept when none given)."""
    if key:
        evidence.environment.device_model = key
    return evidence


def analyze(paths: tuple[Path, ...], options: AnalyzeOptions) -> int:
    """`audit analyze`: the rules on recordings and saved runs. A job's per-rank traces are reduced
    on the options' `engine` (auditor.evidence.ranks.engines), with a progress bar over the ranks."""
    from auditor.evidence.allocator.analysis import given_device_memory
    from auditor.evidence.load import load_paths
    from auditor.evidence.ranks.engines import EngineSpec, EngineUnavailable, check_available

    o = options
    device_key = device_option(o.device)
    given, paths = paths, expand_globs(paths)
    for p in paths:
        if not p.exists():
            raise UsageFailure(missing(p))
    allow_sources(o.source_roots, paths)
    config = rule_config(Path.cwd(), o.select, o.ignore)
    if o.address is not None and o.engine not in ("ray", "dask"):
        raise UsageFailure("--address names a ray or dask cluster: give --engine ray or --engine dask with it")
    spec = EngineSpec(engine=o.engine or "local", address=o.address, workers=o.workers, sketch=True)
    try:
        if o.engine is not None:
            check_available(spec)
        with RankProgress(enabled=not o.quiet and sys.stderr.isatty()) as progress:
            evidence = load_paths(list(paths), spec, progress.on_rank)
    except InputError as e:
        raise UsageFailure(str(e)) from None
    except EngineUnavailable as e:
        raise UsageFailure(str(e)) from None
    if paths != given:  # the job is named as the user named it: the pattern, not a thousand paths
        evidence.target = " ".join(str(p) for p in given)
    echo_unread(evidence)
    out = output_dir(o.out, "analyze")
    with given_device_memory(o.device_memory):
        return finish(with_device(evidence, device_key), config, out, o.quiet, o.fail_on, verbose=o.verbose)


def missing(p: Path) -> str:
    """Why `p` (which does not exist) cannot be read: a symlink leading nowhere is not a missing file."""
    if p.is_symlink():
        try:
            p.resolve(strict=True)
        except RuntimeError:  # (Python < 3.13 raises this for a loop)
            return f"{p}: a symlink loop"
        except OSError as e:
            if e.errno == errno.ELOOP:
                return f"{p}: a symlink loop"
        return f"{p}: a symlink to {os.readlink(p)}, which does not exist"
    return f"no such file or directory: {p}"


def expand_globs(paths: tuple[Path, ...]) -> tuple[Path, ...]:
    """Inputs as given, a pattern the shell left unexpanded (`'traces/rank*.json.gz'`, quoted so
    that a thousand names do not overflow the command line) replaced by the paths it matches, in
    order; a pattern that matches nothing stays as it is (and is reported missing)."""
    import glob

    out: list[Path] = []
    for p in paths:
        text = str(p)
        hits = sorted(glob.glob(text)) if not p.exists() and glob.has_magic(text) else []
        if hits:
            out.extend(Path(h) for h in hits)
        else:
            out.append(p)
    return tuple(out)


class RankProgress:
    """A progress bar over a job's ranks on stderr (rich), while their traces are reduced."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._progress = None
        self._task = None

    def __enter__(self) -> "RankProgress":
        return self

    def on_rank(self, result, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self._progress is None:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("[bold]audit[/] ranks"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            self._progress.start()
            self._task = self._progress.add_task("ranks", total=total)
        self._progress.update(self._task, completed=done)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()


# How many unread ranks are named on stderr, one line each (the rest are counted).
UNREAD_LINES = 10


def echo_unread(evidence) -> None:
    """One line on stderr per rank input, or trace found in a directory, that could not be read
    (the rest were analysed)."""
    from auditor.evidence.load import UNREAD_TRACES
    from auditor.reports.terminal import printable

    traces = evidence.__dict__.get(UNREAD_TRACES, [])
    if traces:
        click.echo(f"audit: {len(traces)} trace(s) not read, the others analysed:", err=True)
        for _, why in traces[:UNREAD_LINES]:
            click.echo(f"audit:   {printable(why)}", err=True)
        if len(traces) > UNREAD_LINES:
            click.echo(f"audit:   ... and {len(traces) - UNREAD_LINES} more (listed in the report)", err=True)
    rs = evidence.ranks
    if rs is None or not rs.unread:
        return
    click.echo(f"audit: {len(rs.unread)} rank input(s) not read, the other {len(rs.ranks)} analysed:", err=True)
    for u in rs.unread[:UNREAD_LINES]:
        click.echo(f"audit:   {printable(u.reason)}", err=True)
    if len(rs.unread) > UNREAD_LINES:
        click.echo(f"audit:   ... and {len(rs.unread) - UNREAD_LINES} more (listed in the report)", err=True)


def report(run_dir: Path, select: tuple[str, ...], ignore: tuple[str, ...],
           source_roots: tuple[Path, ...] = (), verbose: bool = False) -> int:
    """`audit report`: a saved run directory's reports written again, into it. Its exit code is 0
    whatever the findings (no --fail-on), 2 when an output could not be written."""
    from auditor.evidence.load import load_paths
    from auditor.evidence.store import is_run_dir

    if not is_run_dir(run_dir):
        raise UsageFailure(f"{run_dir}: not an audit output directory (no evidence.json)")
    try:  # the reports are written back into it (a copy from a cluster may be read-only)
        write_probe(run_dir)
    except OSError as e:
        raise UsageFailure(f"{run_dir}: cannot write the reports there ({e.strerror or e}); "
                           f"`audit analyze {run_dir} --out DIR` writes them elsewhere") from None
    refuse_planted(run_dir, named="", reports=True)
    allow_sources(source_roots, [run_dir])
    config = rule_config(Path.cwd(), select, ignore)
    try:
        evidence = load_paths([run_dir])
    except InputError as e:
        raise UsageFailure(str(e)) from None
    from auditor.verify import saved_amend

    # (a run verified with --verify keeps its fixes' verification: one taken out stays out)
    code = finish(evidence, config, run_dir, quiet=False, fail_on=None, amend=saved_amend(run_dir), verbose=verbose)
    return EXIT_USAGE if code == EXIT_USAGE else EXIT_OK


def checkpoint(file: Path, options: CheckpointOptions) -> int:
    """`audit checkpoint`: a saved checkpoint's evidence (auditor.evidence.checkpoint), then finish."""
    from auditor.evidence.checkpoint import checkpoint_evidence

    o = options
    if not file.exists():
        raise UsageFailure(f"no such file: {file}")
    if o.against is not None and not o.against.is_file():
        raise UsageFailure(f"no such config file: {o.against}")
    allow_sources((), ())  # (a checkpoint quotes no source)
    config = rule_config(Path.cwd(), o.select, o.ignore)
    try:
        evidence = checkpoint_evidence(file, o.against)
    except InputError as e:
        raise UsageFailure(str(e)) from None
    out = output_dir(o.out, f"checkpoint-{file.stem}")
    return finish(evidence, config, out, o.quiet, o.fail_on, verbose=o.verbose)


# --- comparisons (auditor.diff) -------------------------------------------------------------------

def diff(path_a: Path, path_b: Path, out_dir: Path | None, fail_on_regression: float | None, quiet: bool) -> int:
    """`audit diff A B`: both inputs loaded and audited, compared, the comparison printed and
    written to diff.json and diff.html. Exit 1 when --fail-on-regression PCT is given and B's
    run's time per step (its median step where a side has none) is slower than A's by more than
    PCT percent; 2 for an unreadable input."""
    from auditor.diff import compare_paths, regression
    from auditor.reports.diff_report import print_diff, write_diff

    for p in (path_a, path_b):
        if not p.exists():
            raise UsageFailure(f"no such file or directory: {p}")
    allow_sources((), (path_a, path_b))
    config = rule_config(Path.cwd(), (), ())
    try:
        comparison = compare_paths(path_a, path_b, config)
    except InputError as e:
        raise UsageFailure(str(e)) from None
    out = output_dir(out_dir, "diff")
    try:
        written = write_diff(out, comparison)
    except OSError as e:  # (each written whole or not at all: an earlier diff's are left as they were)
        raise UsageFailure(f"{out}: could not write diff.json and diff.html ({e.strerror or e})") from None
    if not quiet:
        print_diff(comparison)
    click.echo(f"diff: {written['html']}  (also {written['json']})")
    line = regression(comparison, fail_on_regression) if fail_on_regression is not None else None
    if line:
        click.echo(line)
        return EXIT_FAIL_ON
    return EXIT_OK


def load_baseline(path: Path | None):
    """--baseline DIR, loaded before the run starts, so an unreadable one costs the user no run."""
    if path is None:
        return None
    from auditor.diff import load_side

    try:
        return load_side(path)
    except InputError as e:
        raise UsageFailure(f"--baseline: {e}") from None


def compare_with_baseline(evidence, results, baseline, label: str, config: Config):
    """The run against its --baseline (auditor.diff), attached to the evidence as `baseline` for the
    reports (findings.json's `baseline` key, report.html's "Compared with baseline")."""
    from auditor.diff import compare_runs, run_rules_on

    comparison = compare_runs(baseline, run_rules_on(baseline, config), label, evidence, results, evidence.target)
    evidence.__dict__["baseline"] = comparison
    return comparison
