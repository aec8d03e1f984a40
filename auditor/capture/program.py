"""A whole program in the child, run as Python runs it: `audit run file.py`, `audit run -m pkg.mod`.

The program runs through runpy as `python file.py ARGS` / `python -m pkg.mod ARGS` would run it:
`__name__ == "__main__"`, `__file__` the script's, `sys.argv` its path (a module's file) and ARGS,
`sys.path[0]` the script's directory (for -m: the current directory), the current directory and
stdin unchanged. Its steps are found by auditor.capture.steps and measured by StepSession; the
records it sends are those of the step-function mode, plus "outside" (what ran between and after
the steps) and "program" (how the steps were found, how the program ended).
"""
from __future__ import annotations

import importlib.util
import os
import runpy
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from auditor.capture import graphs, wire
from auditor.capture.frames import is_library
from auditor.capture.session import StepSession
from auditor.capture.steps import StepFinder, StepsDone, makes_no_optimizer
from auditor.capture.target import Target, TargetError
from auditor.capture.user_traceback import print_users_traceback
from auditor.evidence.model import Program


@dataclass
class ChildParts:
    """What the child made for the run, handed to the program's run.

    out: the evidence Writer; rec: the probes' Recorder; collectors: the loaded collectors;
    prof: the Profiler (window planned over the audited steps); scans: the graph-scan points;
    send_setup: sends the setup record; ending: the `ended` record of an exception
    (`child._ending(exc, step, devices)`); backend_flags, cuda_devices: read when the run ends."""

    out: Any
    rec: Any
    collectors: list
    prof: Any
    scans: set[int]
    send_setup: Callable[[], None]
    ending: Callable[..., wire.Ended]
    backend_flags: Callable[[], dict]
    cuda_devices: Callable[[], list]


def check_module(name: str) -> str:
    """The file `python -m name` would run; TargetError when there is no such module. Finding it
    imports its parent packages, as `python -m` does."""
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError as e:
        parts = name.split(".")
        if e.name in {".".join(parts[:i]) for i in range(1, len(parts) + 1)}:
            raise TargetError(f"no such module: {name}") from None
        raise
    if spec is None:
        raise TargetError(f"no such module: {name}")
    if spec.submodule_search_locations is not None:  # a package runs its __main__
        return check_module(name + ".__main__")
    return spec.origin or name


def run_program(target: Target, args: Any, parts: ChildParts) -> int:
    """Run the program, audit its steps, send every record; returns the exit code Python would
    end it with (0 also when the audit ended it after its steps)."""
    out = parts.out
    try:
        origin = check_module(target.module) if target.kind == "module" else target.file
    except TargetError as e:
        out.send(wire.UsageError(message=str(e)))
        return 2
    except BaseException as e:  # a parent package's __init__ failed
        parts.send_setup()
        out.send(parts.ending(e, None, parts.cuda_devices()))
        return 1
    argv = [target.spec if target.kind == "script" else origin, *args.script_args]
    sys.argv = list(argv)
    if target.kind == "script":
        sys.path[0] = os.path.dirname(target.file)

    def scan_target() -> tuple[Any, str | None, Any]:
        main = sys.modules.get("__main__")
        return (main if getattr(main, "__file__", None) == origin else None), origin, None

    session = StepSession(out, parts.rec, parts.prof, parts.collectors, parts.scans, scan_target)
    no_optimizer = makes_no_optimizer(target.file if target.kind == "script" else None,
                                      target.module if target.kind == "module" else None)
    opts = args.options
    finder = StepFinder(session, parts.rec, out.send, opts.steps, opts.skip, opts.to_end, parts.send_setup,
                        no_optimizer=no_optimizer)
    finder.install()
    code, after_stop, ending, raised = _run_target(target, finder, parts)
    ended_by_audit = finder.stopped
    failed_in_step = ending is not None and _open_step(finder) is not None
    failed_step = _open_step(finder) if failed_in_step else None
    finder.finish(failed=failed_in_step)
    if failed_step is None and finder.recorded:  # the error fell between steps: after the last one
        failed_step = finder.recorded - 1
    if failed_step is not None and raised is not None and not isinstance(raised, KeyboardInterrupt):
        _failure_scan(out, raised, failed_step, scan_target())
    session.finish()
    parts.prof.stop()
    if parts.prof.window():
        out.send(wire.Profile(steps=[s for s in parts.prof.recorded_steps() if s < finder.recorded],
                              trace_files=parts.prof.files, top_ops=parts.prof.top_ops, snapshots=parts.prof.snapshots,
                              cut=parts.prof.cut, trace_bytes=parts.prof.trace_bytes,
                              drop=parts.prof.drop, unwritten=parts.prof.unwritten, notes=parts.prof.notes))
    for c in parts.collectors:
        data = c.finish()
        if data is not None:
            out.send(wire.Collected(name=c.name, data=data))
    steps_by, steps_found = finder.found()
    out.send(wire.ProgramRun(run=Program(form=target.kind, argv=argv, steps_by=steps_by, steps_found=steps_found,
                                         skipped=min(opts.skip, finder.begun), ended_by_audit=ended_by_audit,
                                         exit_code=code, after_stop=after_stop)))
    if ending is not None:
        ending.cuda_devices = parts.cuda_devices()
        out.send(ending)
    else:
        message = (f"the audit ended the program after {finder.recorded} step(s) (--steps {opts.steps}), "
                   f"at a step boundary, as a Ctrl-C does"
                   + (f"; the program caught that interrupt, went on and raised {after_stop} (as after a Ctrl-C "
                      "there)" if after_stop else "") if ended_by_audit else
                   "the program ran to its end" if code == 0 else None)
        out.send(wire.Ended(status="completed", message=message, backend_flags=parts.backend_flags(),
                            cuda_devices=parts.cuda_devices()))
    return 0 if code is None else code


def _run_target(target: Target, finder: StepFinder,
                parts: ChildParts) -> tuple[int | None, str, wire.Ended | None, BaseException | None]:
    """Run the program as Python runs it: its exit code (None: the audit ended it), what it raised
    after it caught the audit's interrupt, the ending to send (a failure), and its own error."""
    code: int | None = 0
    after_stop = ""  # what the program raised after it caught the audit's interrupt
    ending: wire.Ended | None = None
    raised: BaseException | None = None  # the program's own error, which a graph scan follows
    try:
        if target.kind == "script" and target.file.endswith(".py"):
            run_script(target.file, sys.argv[0])
        elif target.kind == "script":  # (a zip file or a .pyc: runpy knows them)
            runpy.run_path(target.file, run_name="__main__")
        else:
            runpy.run_module(target.module, run_name="__main__", alter_sys=True)
    except StepsDone:
        code = None
    except KeyboardInterrupt as e:
        if finder.stopped:  # (the program caught StepsDone and ended with an interrupt of its own)
            code = None
        else:
            print_users_traceback(e)  # (a Ctrl-C: as Python prints it)
            ending = parts.ending(e, _open_step(finder))
            code = 130
    except SystemExit as e:
        code = _exit_code(e)
        if finder.stopped and _ends_interrupt(e):
            code = None  # (a framework that turns the interrupt into an exit: Lightning's sys.exit(1))
        elif code != 0:
            ending = parts.ending(e, _open_step(finder))
    except BaseException as e:  # the program's own error: printed as Python prints it
        print_users_traceback(e)
        if finder.stopped and isinstance(e, Exception):
            # raised after the program caught the audit's interrupt and went on (word_language_model:
            # "Exiting from training early", then a load of the checkpoint its first epoch had not
            # saved yet): its Ctrl-C path, which a Ctrl-C there takes too; the audited steps are whole
            after_stop = f"{type(e).__name__}: {e}"[:300] + _raised_at(e)
            code = None
        else:
            raised = e
            ending = parts.ending(e, _open_step(finder))
            code = 1
    return code, after_stop, ending, raised


def run_script(path: str, argv0: str) -> None:
    """Run the Python file `path` as `python path` does: in a new `__main__` module (which stays
    sys.modules["__main__"] afterwards, as in a plain run: its atexit handlers and pickled classes
    find it), with `__file__` its absolute path and sys.argv[0] the path as the user typed it."""
    import builtins
    import importlib.machinery
    import types

    with open(path, "rb") as f:
        source = f.read()
    code = compile(source, path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __builtins__=builtins,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    sys.modules["__main__"] = main
    sys.argv[0] = argv0
    exec(code, main.__dict__)


def _failure_scan(out: Any, e: BaseException, step: int, target: tuple[Any, str | None, Any]) -> None:
    """A graph scan after the step the program's error ended (an out-of-memory error is where a
    leak ends): the locals of the user's functions the error left (the training loop's `preds`) are
    scanned with the globals, then let go. Best effort: the scan must not hide how the run ended."""
    try:
        frames = [f for f, _ in traceback.walk_tb(e.__traceback__)]
        out.send(wire.GraphScan(after_step=step, failed=True, **graphs.scan(*target, frames=frames)))
        del frames
        traceback.clear_frames(e.__traceback__)
    except Exception:
        pass


def _raised_at(e: BaseException) -> str:
    """' at FILE:LINE' of the deepest frame of the program's own files (not a library's, nor the audit's)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not is_library(f.filename)]
    return f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""


def _ends_interrupt(e: BaseException) -> bool:
    """Whether `e` was raised while handling the audit's StepsDone: a framework's own handling of
    the Ctrl-C the audit ended it with (Lightning's Trainer catches KeyboardInterrupt, tears down,
    then calls sys.exit(1))."""
    seen = set()
    c = e.__context__
    while c is not None and id(c) not in seen:
        if isinstance(c, StepsDone):
            return True
        seen.add(id(c))
        c = c.__context__
    return False


def _open_step(finder: StepFinder) -> int | None:
    """The audited index of the step the program is in now, if any: one that has had its ending
    (its optimizer step) is complete, and what ends the program after it is not in it."""
    it = finder.iteration
    if it is None or it < finder.skip or finder.done or finder.pending:
        return None
    return it - finder.skip


def _exit_code(e: SystemExit) -> int:
    """The exit code Python gives `sys.exit(code)`: 0 for None, the number, else 1 (after printing it)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF if e.code >= 0 else e.code % 256
    print(e.code, file=sys.stderr)
    return 1
