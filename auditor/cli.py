"""The `audit` command line (click): run, analyze, diff, report, checkpoint, rules, explain.

Commands parse their options into one typed record (auditor.command_options), named as the record's
fields, and call the pipelines of auditor.app with it, which return the exit code (listed there,
and in the README).
"""
from __future__ import annotations

import errno
import math
import os
import sys
from pathlib import Path
from typing import Callable

import click
from click.core import ParameterSource

from auditor import __version__, app
from auditor.app import EXIT_INTERNAL, EXIT_OK, EXIT_TARGET_FAILED, EXIT_USAGE, UsageFailure
from auditor.command_options import (MAX_GIB, MAX_SECONDS, MAX_STEPS, MAX_TRACE_MB, MIN_GIB, MIN_TRACE_MB, AnalyzeOptions,
                                     CheckpointOptions, OptionError, OutputOptions, RunOptions, decode)
from auditor.findings import SEVERITIES

_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())

# The ranges the command line's numbers are checked against (a value outside is refused, exit 2,
# the flag named): those of the options' records (auditor.command_options), and diff's percent.
MAX_PERCENT = 1e6
_RUN = RunOptions()  # (the defaults the help shows)
_GIB = f"GiB, from 1 MiB ({MIN_GIB}) to 1 PiB ({MAX_GIB:.0f})"


class Measure(click.ParamType):
    """A finite number in [lo, hi] of `unit`: inf, nan and values no device or run has are
    refused where they are given (click names the flag), not met later inside the audited program."""

    name = "number"

    def __init__(self, lo: float, hi: float, what: str) -> None:
        self.lo, self.hi, self.what = lo, hi, what

    def convert(self, value, param, ctx) -> float:
        if isinstance(value, float):
            v = value
        else:
            try:
                v = float(value)
            except (TypeError, ValueError):
                self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(v) or not self.lo <= v <= self.hi or (self.lo > 0 and v <= 0):
            self.fail(f"{value} is out of range: a number of {self.what}", param, ctx)
        return v

_SHARED_OPTIONS: dict[str, Callable[..., Callable]] = {
    "out": lambda default, quiet_help: click.option(
        "--out", "out", type=click.Path(file_okay=False), default=None,
        callback=lambda ctx, param, value: app.out_option(value), help=f"Output directory [default: {default}]."),
    "fail-on": lambda default, quiet_help: click.option(
        "--fail-on", type=click.Choice(SEVERITIES), default=None,
        help="Exit 1 when a finding has at least this severity."),
    "select": lambda default, quiet_help: click.option(
        "--select", multiple=True, help="Only these rule ids (comma-separated or repeated)."),
    "ignore": lambda default, quiet_help: click.option(
        "--ignore", multiple=True, help="Skip these rule ids (comma-separated or repeated)."),
    "quiet": lambda default, quiet_help: click.option("--quiet", "-q", is_flag=True, help=quiet_help),
    "verbose": lambda default, quiet_help: click.option(
        "--verbose", "-v", is_flag=True, help="The summary in full: how each figure was measured, each finding's whole message."),
    "device": lambda default, quiet_help: click.option(
        "--device", "device", default=None, metavar="NAME",
        help="The GPU to judge kernel efficiency by when a trace does not name it, and to estimate a "
             "rehearsed run's GPU costs on (e.g. h100-sxm, a100-sxm4-80gb, mi300x; an unknown name lists them)."),
    "device-memory": lambda default, quiet_help: click.option(
        "--device-memory", "device_memory", type=Measure(MIN_GIB, MAX_GIB, _GIB), default=None, metavar="GIB",
        help="Memory of the device to simulate the caching allocator on, in GiB (the allocator replay of memory "
             "snapshots; under rehearsal, the device the program's own _dump_snapshot forecasts)."),
}


def shared_options(*names: str, out_default: str = "", quiet_help: str = "Only the one-line summary.") -> Callable:
    """The options several commands share (--out, --fail-on, --select, --ignore, --quiet, --device,
    --device-memory), in the order named; `out_default` is what --out's help names as the default
    directory."""
    def decorate(f: Callable) -> Callable:
        for name in reversed(names):
            f = _SHARED_OPTIONS[name](out_default, quiet_help)(f)
        return f
    return decorate


_SOURCE_ROOT = click.option(
    "--source-root", "source_roots", multiple=True, type=click.Path(path_type=Path), metavar="DIR",
    help="A directory the recorded program's source is in (repeatable): the reports quote source lines "
         "from files under these only, never from elsewhere on this machine [default: none; with an `audit run` "
         "directory: the current directory's git checkout, else the directory].")


def _record(kind: type[OutputOptions], given: dict) -> OutputOptions:
    """The command's options record from its parsed flags (each a field of the same name)."""
    try:
        return kind.checked(**given)
    except OptionError as e:
        flag = next((p.opts[0] for p in click.get_current_context().command.params if p.name == e.option), e.option)
        raise UsageFailure(f"Invalid value for '{flag}': {e.why}" if flag else e.why) from None


def _passed_on(text: str) -> RunOptions:
    """--options-json: the record whole, as `audit run` hands it to a launch's ranks and to --verify's
    re-runs (auditor.launch.rank_argv, auditor.verify.RunSpec); no other option goes with it."""
    ctx = click.get_current_context()
    others = [p.opts[0] for p in ctx.command.params if isinstance(p, click.Option) and p.name not in
              ("module", "options_json") and ctx.get_parameter_source(p.name) is ParameterSource.COMMANDLINE]
    if others:
        raise UsageFailure(f"--options-json holds every option: {', '.join(others)} cannot go with it")
    try:
        return decode(text, RunOptions)
    except OptionError as e:
        raise UsageFailure(f"--options-json: {e}") from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="audit")
def cli() -> None:
    """auditor: find why a PyTorch training step is slow, runs out of memory or turns to NaN."""


class _RunCommand(click.Command):
    """`audit run`: keeps how many arguments followed `--` (ctx.meta["after_dashdash"]), which click
    does not say: with -m, a TARGET before `--` is a stray argument, one after it the program's."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["after_dashdash"] = len(args) - args.index("--") - 1 if "--" in args else 0
        return super().parse_args(ctx, args)


def _stray_with_module(module: str | None, target: str | None, script_args: tuple[str, ...]) -> None:
    """-m runs a module instead of TARGET: an argument before `--` is refused, never passed on."""
    if module is None or target is None:
        return
    if click.get_current_context().meta.get("after_dashdash", 0) > len(script_args):
        return  # (`-m pkg.mod -- ARGS`: click gave the first of ARGS as TARGET)
    raise UsageFailure(f"-m {module} runs a module instead of TARGET, and {target!r} was given too: the program's "
                       f"own arguments go after `--` (audit run -m {module} -- {target} ...)")


@cli.command(cls=_RunCommand)
@click.argument("target", required=False)
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- ARGS...]")
@click.option("-m", "--module", "module", default=None, metavar="PKG.MODULE",
              help="Run this module as a program, as `python -m PKG.MODULE ARGS` does (instead of TARGET: its "
                   "ARGS go after `--`).")
@click.option("--steps", type=click.IntRange(min=1, max=MAX_STEPS), default=_RUN.steps, show_default=True,
              help="Call the step exactly this many times; a program: audit this many of its steps, then end it "
                   "as a Ctrl-C does.")
@click.option("--skip", type=click.IntRange(min=0, max=MAX_STEPS), default=_RUN.skip, show_default=True,
              help="A program: run its first K steps unaudited (warm-up, compilation).")
@click.option("--to-end", is_flag=True,
              help="A program: let it run to its end (--steps then only places the profiler window).")
@shared_options("out", "fail-on", "select", "ignore", out_default="audit-out/<target>-<timestamp>/")
@click.option("--profile/--no-profile", default=_RUN.profile, show_default=True,
              help="Record a torch.profiler window of a few steps.")
@click.option("--profile-memory", "profile_memory", type=Measure(MIN_GIB, MAX_GIB, _GIB), default=None,
              metavar="GIB", help="The most resident memory the profiler window may add to the program, in GiB, its end "
                                  "(the profiler's export) included: the recording ends early where its end, "
                                  "predicted from what it recorded, would pass it, keeping what it recorded "
                                  "[default: half the memory available when the window starts].")
@click.option("--trace-size", "trace_size", type=Measure(MIN_TRACE_MB, MAX_TRACE_MB, "MB, from 0.001 to 1073741824 (1 PiB)"),
              default=None,
              metavar="MB", help="The most the kept profiler trace (compressed, .pt.trace.json.gz) may take, in MB: "
                                 "the recording ends early where its trace would pass it [default: 256].")
@click.option("--rehearse/--no-rehearse", default=None,
              help="Run CUDA code on the CPU, judging it as GPU code [default: when the target asks for "
                   "CUDA and none is present].")
@click.option("--numerics/--no-numerics", default=_RUN.numerics, show_default=True,
              help="Check every op's values (where NaN/Inf start), gradient norms and learning rates. "
                   "Off: no step carries the checks (they run on the first steps, then one in 32, fewer in "
                   "a long run or where a check costs over 2% of the run at that rate; the summary measures their cost), and the numerics rules are skipped.")
@click.option("--open", "open_report", is_flag=True, help="Open report.html in the browser when done.")
@click.option("--tensorboard", is_flag=True,
              help="Start TensorBoard (torch-tb-profiler) on the run's traces, print its URL, serve until Ctrl-C.")
@shared_options("quiet", "verbose", quiet_help="No progress bar; only the one-line summary.")
@click.option("--nproc-per-node", type=click.IntRange(min=1), default=None,
              help="Launch this many ranks with torch.distributed.run (the target calls init_process_group).")
@click.option("--verify", is_flag=True,
              help="After the audit, re-run the target on a scratch copy of the project with its fixes applied "
                   "(fixes.patch at once, each numerics fix apart); fixes that fail, change the weights or leave "
                   "their finding are taken out of the patch files.")
@click.option("--digest", is_flag=True, hidden=True,
              help="Record a digest of the trained weights at the end of the audited steps (--verify's re-runs).")
@click.option("--rank-timeout", type=Measure(0, MAX_SECONDS, "seconds, from 0 to a day (86400)"), default=_RUN.rank_timeout,
              show_default=True,
              help="Under a launcher: how long rank 0 waits for the other ranks' evidence, in seconds.")
@click.option("--baseline", type=click.Path(path_type=Path), default=None, metavar="DIR",
              help="Compare this run with a saved `audit run` directory (or a trace): the report, findings.json "
                   "(`baseline`) and the summary show what changed, beside its noise.")
@shared_options("device-memory", "device")
@click.option("--options-json", "options_json", default=None, hidden=True,
              help="Every option at once, as one JSON record (what `audit run` hands a launch's ranks and "
                   "--verify's re-runs).")
def run(target: str | None, script_args: tuple[str, ...], module: str | None, options_json: str | None,
        **given) -> None:
    """Audit TARGET: path/to/file.py:step or package.module:step (the step called N times), or a
    whole program, path/to/file.py or -m package.module (run as Python runs it, its steps found).

    ARGS after `--` are the program's own command line: its code finds them in sys.argv[1:]."""
    _stray_with_module(module, target, script_args)
    options = _passed_on(options_json) if options_json is not None else _record(RunOptions, given)
    sys.exit(app.run(target, options, module=module, args=script_args))


@cli.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@shared_options("out", "fail-on", "select", "ignore", "quiet", "verbose", "device", "device-memory",
                out_default="audit-out/analyze-<timestamp>/")
@click.option("--engine", type=click.Choice(["local", "ray", "dask"]), default=None,
              help="Where a job's per-rank traces are reduced: local (a process pool on this machine), ray or dask "
                   "(a cluster, with `pip install 'auditor[ray]'` / `'auditor[dask]'`) [default: local].")
@click.option("--address", default=None, metavar="ADDR",
              help="The ray or dask cluster to use [default: RAY_ADDRESS / DASK_SCHEDULER_ADDRESS, else a local "
                   "one started for the run].")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Workers that reduce the ranks (local: processes) [default: one per core].")
@_SOURCE_ROOT
def analyze(paths: tuple[Path, ...], **given) -> None:
    """Run the rules on recordings: profiler traces, TensorBoard logdirs, memory snapshots, or
    `audit run` output directories. PATHS may be glob patterns (quoted: 'traces/*.json.gz')."""
    sys.exit(app.analyze(paths, _record(AnalyzeOptions, given)))


@cli.command("diff")
@click.argument("a", type=click.Path(path_type=Path))
@click.argument("b", type=click.Path(path_type=Path))
@click.option("--fail-on-regression", type=Measure(0, MAX_PERCENT, "percent, from 0 to 1000000"), default=None, metavar="PCT",
              help="Exit 1 when B's run's time per step (its median step where a side has none) is slower "
                   "than A's by more than PCT percent.")
@shared_options("out", "quiet", out_default="audit-out/diff-<timestamp>/", quiet_help="Only the closing lines.")
def diff_cmd(a: Path, b: Path, fail_on_regression: float | None, out: Path | None, quiet: bool) -> None:
    """Compare two audits: A and B are each an `audit run` output directory, a profiler trace
    (.json/.json.gz) or a TensorBoard logdir. Shows the run's time per step and its parts, the
    median step, per-phase, per-op (GPU kernels) time, syncs, copies, memory and findings side by
    side, each change with its noise; writes diff.json and diff.html."""
    sys.exit(app.diff(a, b, out, fail_on_regression, quiet))


@cli.command()
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@shared_options("select", "ignore", "verbose")
@_SOURCE_ROOT
def report(run_dir: Path, select: tuple[str, ...], ignore: tuple[str, ...], source_roots: tuple[Path, ...] = (),
           verbose: bool = False) -> None:
    """Re-render the reports of a saved run directory (no code is re-run)."""
    sys.exit(app.report(run_dir, select, ignore, source_roots, verbose))


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
    click.echo(cls.explanation(), nl=False)


@cli.command()
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--against", "against", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="A YAML/JSON/TOML config (lr, weight_decay, betas, a scheduler section) to compare with.")
@shared_options("out", "fail-on", "select", "ignore", "quiet", "verbose",
                out_default="audit-out/checkpoint-<name>-<timestamp>/")
def checkpoint(file: Path, **given) -> None:
    """Audit a saved checkpoint: non-finite or extreme tensors, optimizer state health, and the
    stored learning rate against CONFIG. FILE is a torch.save file, a .safetensors file, or a
    Hugging Face Trainer checkpoint directory (weights, optimizer.pt, scheduler.pt,
    trainer_state.json). Loads with torch.load(weights_only=True) only: a file that needs more
    (it pickles its own classes) is refused, since unpickling it could run code."""
    sys.exit(app.checkpoint(file, _record(CheckpointOptions, given)))


class Terminated(BaseException):
    """SIGTERM reached `audit` outside a run's child (which auditor.capture.runner stops and
    reports on): the command ends as a Ctrl-C ends it, exit 3, its temporary files and its lock
    removed on the way out (a BaseException: no `except Exception` of the pipeline swallows it)."""


def _terminated(signum, frame) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> None:
    """Entry point: click in non-standalone mode so every usage error is one line and exit 2."""
    import signal
    import threading

    from auditor.evidence import source_access

    here = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, _terminated) if here else None
    try:
        with source_access.kept():  # (each command sets the roots its source is read under)
            rv = cli.main(args=argv, prog_name="audit", standalone_mode=False)
    except Terminated:
        click.echo("audit: stopped by SIGTERM", err=True)
        sys.exit(EXIT_TARGET_FAILED)
    except UsageFailure as e:
        from auditor.reports.terminal import printable

        click.echo(f"audit: error: {printable(str(e))}", err=True)
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
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
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
