"""auditor from Python: `analyze`, `run` and `load` return an Audit (auditor.audit); `compare` is
`audit diff`'s comparison.

`analyze` and `run` call the pipelines `audit analyze` and `audit run` call (auditor.app), with the
commands' options as keywords (the fields of auditor.command_options' records: `out`, `select`,
`steps` ...): an audit made here is the command's, the same outputs in the same directory (its
default, audit-out/<name>-<timestamp>, named before the pipeline runs so that the Audit can read
it). They print only the command's closing line unless given quiet=False. An audit that cannot be
made raises auditor.AuditError with the command's message and exit code; an audit made whose run
failed is returned, its exit_code the command's (3: the target failed).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from auditor.audit import Audit, compare
from auditor.errors import EXIT_USAGE, AuditError

if TYPE_CHECKING:
    from auditor.command_options import OutputOptions

__all__ = ["analyze", "run", "load", "compare", "Audit", "AuditError"]

PathLike = str | os.PathLike


def analyze(*paths: PathLike, **options: Any) -> Audit:
    """`audit analyze PATHS`: the rules on recordings (profiler traces, TensorBoard logdirs, memory
    snapshots) and `audit run` output directories. `options`: AnalyzeOptions' fields."""
    from auditor import app
    from auditor.command_options import AnalyzeOptions

    if not paths:
        raise AuditError("analyze: give the recordings or output directories to analyze")
    given = tuple(Path(p) for p in paths)
    o = _options(AnalyzeOptions, options)
    return _made(o, "analyze", lambda o: app.analyze(given, o))


def run(target: str, steps: int = 30, args: Sequence[str] = (), module: bool = False, **options: Any) -> Audit:
    """`audit run TARGET --steps N -- ARGS`: `target` is path/to/file.py:step or package.module:step
    (the step called `steps` times) or a whole program, path/to/file.py, or with module=True a
    module run as `python -m` runs it; `args` its command line. `options`: RunOptions' fields."""
    from auditor import app
    from auditor.command_options import RunOptions

    argv = tuple(str(a) for a in args)
    file, mod = (None, target) if module else (target, None)
    o = _options(RunOptions, {"steps": steps, **options})
    name = app.run_target(file, mod, argv)[0].name  # (a TARGET that is none: AuditError before any output)
    return _made(o, name, lambda o: app.run(file, o, module=mod, args=argv))


def load(out_dir: PathLike) -> Audit:
    """The audit an `audit` command (or `analyze` / `run`) wrote in `out_dir`."""
    return Audit.read(Path(out_dir))


def _options(kind: type[OutputOptions], given: dict[str, Any]) -> Any:
    """The command's options record from keywords, quiet unless told otherwise; a value the record
    refuses is an AuditError naming the keyword (exit 2, as the flag's is)."""
    from auditor.command_options import OptionError

    try:
        return kind.checked(**{"quiet": True, **given})
    except OptionError as e:
        raise AuditError(str(e)) from None


def _made(options: Any, name: str, pipeline: Callable[[Any], int]) -> Audit:
    """The Audit the pipeline writes: into options.out, or the command's default directory for
    `name`, claimed first. Its lock is released when it is written (a notebook lives on)."""
    import msgspec

    from auditor import app
    from auditor.evidence import source_access

    with source_access.kept():
        out = options.out if options.out is not None else app.output_dir(None, name)
        try:
            code = pipeline(msgspec.structs.replace(options, out=out))
        except BaseException:
            app.drop_if_unused(out)
            raise
        finally:
            app.release(out)
    if code == EXIT_USAGE:  # (the warnings above named what)
        raise AuditError(f"{out}: the audit's outputs could not all be written")
    return Audit.read(out, code)
