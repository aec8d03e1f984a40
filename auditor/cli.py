"""The `audit` command line: run, analyze, report, rules, explain.

Exit codes (a contract, documented in the README):
  0  audit done, no finding at or above --fail-on (or --fail-on not given)
  1  a finding at or above --fail-on
  2  usage error: bad TARGET, missing file, no such callable, bad option or input file
  3  the target failed: its step or setup raised, was interrupted, ran out of memory or crashed
  4  internal error of the auditor itself (one line; AUDIT_DEBUG=1 shows the traceback)
"""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import click

from auditor import __version__
from auditor.config import Config, ConfigError, load_config
from auditor.evidence.errors import InputError
from auditor.findings import SEVERITIES, severity_rank

EXIT_OK, EXIT_FAIL_ON, EXIT_USAGE, EXIT_TARGET_FAILED, EXIT_INTERNAL = 0, 1, 2, 3, 4
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


class UsageFailure(Exception):
    """Printed as one line on stderr; exit 2."""


def _default_out(name: str) -> Path:
    """audit-out/<name>-<timestamp>, the name cut to 100 characters: a file name may be 255 bytes
    long, and `checkpoint-<a 240-character file name>-<timestamp>` could not be made."""
    return Path("audit-out") / f"{name[:100]}-{time.strftime('%Y%m%d-%H%M%S')}"


_MADE: set[Path] = set()  # output directories this command created (see _out, _drop_if_unused)


def _out(out_dir: Path | None, name: str) -> Path:
    """The output directory (--out, or the default for `name`), created now: a path that cannot
    be written is the user's to fix (exit 2), found before anything runs."""
    out = out_dir or _default_out(name)
    try:
        if not out.exists():
            _MADE.add(out)
        out.mkdir(parents=True, exist_ok=True)
        _write_probe(out)
    except OSError as e:
        raise UsageFailure(f"--out {out}: cannot write there ({e.strerror or e})") from None
    return out


def _write_probe(directory: Path) -> None:
    """Raises OSError when a file cannot be created in `directory`."""
    probe = directory / f".audit-write-test-{os.getpid()}"
    probe.touch()
    probe.unlink()


def _drop_if_unused(out: Path) -> None:
    """A run that never started (a usage error) leaves no output directory it made itself."""
    if out in _MADE:
        try:
            out.rmdir()  # (only if empty)
        except OSError:
            pass


def _exit_code(evidence, results, fail_on: str | None) -> int:
    from auditor.evidence.model import ended_well

    if evidence.source == "run" and not ended_well(evidence.ending):
        return EXIT_TARGET_FAILED
    if fail_on and any(severity_rank(f.severity) >= severity_rank(fail_on) for f in results.findings):
        return EXIT_FAIL_ON
    return EXIT_OK


def _finish(evidence, config: Config, out: Path, quiet: bool, fail_on: str | None) -> int:
    """Save the evidence, then load -> rules -> reports: the same path `audit analyze DIR` takes."""
    from auditor.evidence.load import load_paths
    from auditor.evidence.model import add_load_note
    from auditor.evidence.store import is_run_dir, save
    from auditor.reports import write_reports
    from auditor.reports.terminal import print_summary
    from auditor.rules.engine import run_rules

    save(evidence, out)
    if evidence.source == "run" and is_run_dir(out):
        try:
            evidence = load_paths([out])  # attaches the profiled window's parsed trace
        except InputError as e:
            add_load_note(evidence, f"profiler trace not analysed: {e}")
    results = run_rules(evidence, config)
    written = write_reports(out, evidence, results)
    unwritten = _unwritten(written)
    if quiet:
        ran = f", run {evidence.ending.status}" if evidence.source == "run" else ""  # (recordings: nothing ran)
        where = f"report in {out}" if "report.html" not in unwritten else f"report not written, outputs in {out}"
        click.echo(f"audit: {len(results.findings)} finding(s){ran}; {where}")
    elif not unwritten:
        print_summary(evidence, results, out)
    else:  # the summary names the outputs found in `out`: an older one there is not this run's
        print_summary(evidence, results, None)
        _echo_written(out, written, unwritten)
    return _exit_code(evidence, results, fail_on or config.fail_on)


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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="audit")
def cli() -> None:
    """auditor: find why a PyTorch training step is slow, runs out of memory or turns to NaN."""


@cli.command()
@click.argument("target", required=False)
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- ARGS...]")
@click.option("-m", "--module", "module", default=None, metavar="PKG.MODULE",
              help="Run this module as a program, as `python -m PKG.MODULE ARGS` does (instead of TARGET).")
@click.option("--steps", type=click.IntRange(min=1), default=50, show_default=True,
              help="Call the step exactly this many times; a program: audit this many of its steps, then end it "
                   "as a Ctrl-C does.")
@click.option("--skip", type=click.IntRange(min=0), default=0, show_default=True,
              help="A program: run its first K steps unaudited (warm-up, compilation).")
@click.option("--to-end", is_flag=True,
              help="A program: let it run to its end (--steps then only places the profiler window).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output directory [default: audit-out/<target>-<timestamp>/].")
@click.option("--fail-on", type=click.Choice(SEVERITIES), default=None,
              help="Exit 1 when a finding has at least this severity.")
@click.option("--select", multiple=True, help="Only these rule ids (comma-separated or repeated).")
@click.option("--ignore", multiple=True, help="Skip these rule ids (comma-separated or repeated).")
@click.option("--profile/--no-profile", default=True, show_default=True,
              help="Record a torch.profiler window of a few steps.")
@click.option("--rehearse/--no-rehearse", default=None,
              help="Run CUDA code on the CPU, judging it as GPU code [default: when the target asks for "
                   "CUDA and none is present].")
@click.option("--numerics/--no-numerics", default=True, show_default=True,
              help="Check every op's values (where NaN/Inf start), gradient norms and learning rates. "
                   "Off: about half the per-step overhead, and the numerics rules are skipped.")
@click.option("--open", "open_report", is_flag=True, help="Open report.html in the browser when done.")
@click.option("--tensorboard", is_flag=True,
              help="Start TensorBoard (torch-tb-profiler) on the run's traces, print its URL, serve until Ctrl-C.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar; only the one-line summary.")
@click.option("--nproc-per-node", type=click.IntRange(min=1), default=None,
              help="Launch this many ranks with torch.distributed.run (the target calls init_process_group).")
@click.option("--rank-timeout", type=click.FloatRange(min=0), default=120.0, show_default=True,
              help="Under a launcher: how long rank 0 waits for the other ranks' evidence, in seconds.")
def run(target: str, steps: int, out_dir: Path | None, fail_on: str | None, select: tuple[str, ...],
        ignore: tuple[str, ...], profile: bool, rehearse: bool | None, open_report: bool, tensorboard: bool,
        quiet: bool, nproc_per_node: int | None = None, rank_timeout: float = 120.0, numerics: bool = True,
        script_args: tuple[str, ...] = (), module: str | None = None, skip: int = 0, to_end: bool = False) -> None:
    """Audit TARGET: path/to/file.py:step or package.module:step (the step called N times), or a
    whole program, path/to/file.py or -m package.module (run as Python runs it, its steps found).

    ARGS after `--` are the program's own command line: its code finds them in sys.argv[1:]."""
    from auditor.capture.progress import StepProgress
    from auditor.capture.runner import RunRequest, run_child
    from auditor.capture.target import TargetError, check_statically, module_target, parse_target

    try:
        if module is not None:  # (`-m pkg.mod -- ARGS`: click gives the first of ARGS as TARGET)
            script_args = ((target,) if target is not None else ()) + tuple(script_args)
            t = module_target(module)
        elif target is None:
            raise TargetError("missing TARGET (path/to/file.py, path/to/file.py:callable, package.module:callable) "
                              "or -m package.module")
        else:
            t = parse_target(target)
    except TargetError as e:
        raise UsageFailure(str(e)) from None
    if (skip or to_end) and not t.is_program:
        raise UsageFailure("--skip and --to-end apply to a whole program (path/to/file.py or -m package.module), "
                           "not to a step callable")
    target = t.spec
    config = _config(Path(t.file).parent if t.file else Path.cwd(), select, ignore)
    # -- distributed (auditor.capture.distributed): launch N ranks, or be one rank of a launch --
    from auditor.capture import distributed

    session = distributed.RankSession.from_env(out_dir, t.name)
    if nproc_per_node is not None:
        if session is not None:
            raise UsageFailure("--nproc-per-node: already running under a launcher (RANK is set)")
        if t.is_program:
            raise UsageFailure("--nproc-per-node takes a step callable (path/to/file.py:step) for now; "
                               "launch a whole program with torchrun ... -m auditor run path/to/file.py")
        try:
            check_statically(t)  # a rank's usage error would reach us only as the launcher's failure
        except TargetError as e:
            raise UsageFailure(str(e)) from None
        out = _out(out_dir, t.name)
        _prewarm_report()
        code = distributed.launch(target, nproc_per_node, out,
                                  distributed.rank_argv(steps, profile, rehearse, numerics, script_args),
                                  lambda ev: _finish(ev, config, out, quiet, fail_on))
        _afterwards(out, open_report, tensorboard)
        sys.exit(code)
    out = session.run_dir if session is not None else _out(out_dir, t.name)
    # -- end distributed --
    if session is None or session.env.merges():  # (only the merging process writes the report)
        _prewarm_report()
    with StepProgress(steps, enabled=not quiet and sys.stderr.isatty() and distributed.shows_progress(session)) \
            as progress, distributed.stoppable(session):
        try:
            mode = "auto" if rehearse is None else "on" if rehearse else "off"
            extra = ("--rehearse", mode, *(() if numerics else ("--no-numerics",)),
                     *(("--skip", str(skip)) if skip else ()), *(("--to-end",) if to_end else ()))
            evidence = run_child(RunRequest(t, steps, out, profile=profile, extra_args=extra, script_args=script_args,
                                            catch_sigterm=session is None),
                                 on_record=progress.on_record)
        except TargetError as e:
            _drop_if_unused(out)
            raise UsageFailure(str(e)) from None
    if session is not None:  # distributed: save this rank; the merging rank reports on every rank
        sys.exit(session.finish(evidence, rank_timeout, lambda ev, root: _finish(ev, config, root, quiet, fail_on)))
    code = _finish(evidence, config, out, quiet, fail_on)
    _afterwards(out, open_report, tensorboard)
    sys.exit(code)


@cli.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output directory [default: audit-out/analyze-<timestamp>/].")
@click.option("--fail-on", type=click.Choice(SEVERITIES), default=None)
@click.option("--select", multiple=True)
@click.option("--ignore", multiple=True)
@click.option("--quiet", "-q", is_flag=True)
def analyze(paths: tuple[Path, ...], out_dir: Path | None, fail_on: str | None, select: tuple[str, ...],
            ignore: tuple[str, ...], quiet: bool) -> None:
    """Run the rules on recordings: profiler traces, TensorBoard logdirs, memory snapshots, or
    `audit run` output directories."""
    from auditor.evidence.load import load_paths

    for p in paths:
        if not p.exists():
            raise UsageFailure(f"no such file or directory: {p}")
    config = _config(Path.cwd(), select, ignore)
    try:
        evidence = load_paths(list(paths))
    except InputError as e:
        raise UsageFailure(str(e)) from None
    out = _out(out_dir, "analyze")
    sys.exit(_finish(evidence, config, out, quiet, fail_on))


@cli.command()
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--select", multiple=True)
@click.option("--ignore", multiple=True)
def report(run_dir: Path, select: tuple[str, ...], ignore: tuple[str, ...]) -> None:
    """Re-render the reports of a saved run directory (no code is re-run)."""
    from auditor.evidence.load import load_paths
    from auditor.evidence.store import is_run_dir

    if not is_run_dir(run_dir):
        raise UsageFailure(f"{run_dir}: not an audit output directory (no evidence.json)")
    try:  # the reports are written back into it (a copy from a cluster may be read-only)
        _write_probe(run_dir)
    except OSError as e:
        raise UsageFailure(f"{run_dir}: cannot write the reports there ({e.strerror or e}); "
                           f"`audit analyze {run_dir} --out DIR` writes them elsewhere") from None
    config = _config(Path.cwd(), select, ignore)
    try:
        evidence = load_paths([run_dir])
    except InputError as e:
        raise UsageFailure(str(e)) from None
    _finish(evidence, config, run_dir, quiet=False, fail_on=None)


@cli.command("rules")
def rules_cmd() -> None:
    """List every rule: id, default severity, category, title."""
    from rich.console import Console
    from rich.table import Table

    from auditor.rules.registry import all_rules

    table = Table("id", "severity", "category", "title", box=None)
    for rule_id, cls in all_rules().items():
        table.add_row(rule_id, cls.severity, cls.category, cls.title)
    Console(width=max(100, Console().width)).print(table)


@cli.command()
@click.argument("rule_id")
def explain(rule_id: str) -> None:
    """Print a rule's documentation and options."""
    from auditor.rules.registry import get_rule

    cls = get_rule(rule_id)
    if cls is None:
        raise UsageFailure(f"no rule {rule_id!r} (see `audit rules`)")
    click.echo(f"{cls.id}: {cls.title}\nseverity: {cls.severity}    category: {cls.category}\n")
    click.echo(cls.docs())
    if cls.options:
        click.echo(f"\nOptions ([tool.auditor.rules.{cls.id}] in pyproject.toml):")
        for o in cls.options:
            click.echo(f"    {o.name} = {o.default!r}    {o.help}")


def _prewarm_report() -> None:
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


def _afterwards(out: Path, open_report: bool, tensorboard: bool) -> None:
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


@cli.command()
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--against", "config_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="A YAML/JSON/TOML config (lr, weight_decay, betas, a scheduler section) to compare with.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output directory [default: audit-out/checkpoint-<name>-<timestamp>/].")
@click.option("--fail-on", type=click.Choice(SEVERITIES), default=None,
              help="Exit 1 when a finding has at least this severity.")
@click.option("--select", multiple=True, help="Only these rule ids (comma-separated or repeated).")
@click.option("--ignore", multiple=True, help="Skip these rule ids (comma-separated or repeated).")
@click.option("--quiet", "-q", is_flag=True, help="Only the one-line summary.")
def checkpoint(file: Path, config_file: Path | None, out_dir: Path | None, fail_on: str | None,
               select: tuple[str, ...], ignore: tuple[str, ...], quiet: bool) -> None:
    """Audit a saved checkpoint: non-finite or extreme tensors, optimizer state health, and the
    stored learning rate against CONFIG. FILE is a torch.save file, a .safetensors file, or a
    Hugging Face Trainer checkpoint directory (weights, optimizer.pt, scheduler.pt,
    trainer_state.json). Loads with torch.load(weights_only=True) only: a file that needs more
    (it pickles its own classes) is refused, since unpickling it could run code."""
    from auditor.evidence.checkpoint import checkpoint_evidence

    if not file.exists():
        raise UsageFailure(f"no such file: {file}")
    if config_file is not None and not config_file.is_file():
        raise UsageFailure(f"no such config file: {config_file}")
    config = _config(Path.cwd(), select, ignore)
    try:
        evidence = checkpoint_evidence(file, config_file)
    except InputError as e:
        raise UsageFailure(str(e)) from None
    out = _out(out_dir, f"checkpoint-{file.stem}")
    sys.exit(_finish(evidence, config, out, quiet, fail_on))


def _config(start: Path, select: tuple[str, ...], ignore: tuple[str, ...]) -> Config:
    try:
        return load_config(start, select, ignore)
    except ConfigError as e:
        raise UsageFailure(str(e)) from None


def main(argv: list[str] | None = None) -> None:
    """Entry point: click in non-standalone mode so every usage error is one line and exit 2."""
    try:
        rv = cli.main(args=argv, prog_name="audit", standalone_mode=False)
    except UsageFailure as e:
        click.echo(f"audit: error: {e}", err=True)
        sys.exit(EXIT_USAGE)
    except _NO_ARGS_IS_HELP:  # `audit` alone: click raises after printing the help
        sys.exit(EXIT_USAGE)
    except click.UsageError as e:
        click.echo(f"audit: error: {e.format_message()}", err=True)
        sys.exit(EXIT_USAGE)
    except click.exceptions.Abort:
        click.echo("audit: aborted", err=True)
        sys.exit(EXIT_TARGET_FAILED)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except OSError as e:
        if e.errno != errno.ENAMETOOLONG or os.environ.get("AUDIT_DEBUG"):
            _internal_error(e)
        # a path the user gave (or an output named after it) that the system cannot even look up
        click.echo(f"audit: error: {_clipped(e.filename)}: {e.strerror.lower() if e.strerror else e}", err=True)
        sys.exit(EXIT_USAGE)
    except Exception as e:  # a bug of ours: one line, the traceback only on request
        _internal_error(e)
    sys.exit(rv if isinstance(rv, int) else EXIT_OK)


def _clipped(name: object, keep: int = 80) -> str:
    """A path for the one-line error: its start and end, when it is a few thousand characters."""
    if not isinstance(name, (str, bytes)):
        return "a path"
    text = os.fsdecode(name)
    return text if len(text) <= keep else f"{text[:keep // 2]}...{text[-keep // 2:]} ({len(text):,} characters)"


def _internal_error(e: Exception) -> None:
    if os.environ.get("AUDIT_DEBUG"):
        raise e
    click.echo(f"audit: internal error: {type(e).__name__}: {e} (set AUDIT_DEBUG=1 for the traceback)",
               err=True)
    sys.exit(EXIT_INTERNAL)
