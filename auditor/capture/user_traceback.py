"""The traceback a plain run prints when the program's error (or a Ctrl-C) ends it, printed by the
audited child on stderr where the program's own output goes: the program's frames and the
libraries' it called, without the auditor's (its step loop, its probes around torch's calls, its
signal handler) or runpy's, which a plain run does not have. Chained exceptions are printed as
Python prints them, each with its frames filtered alike."""
from __future__ import annotations

import os
import runpy
import sys
import traceback

import auditor

_NOT_THE_PROGRAMS = (os.path.dirname(os.path.abspath(auditor.__file__)) + os.sep, os.path.abspath(runpy.__file__))


def _programs(stack: traceback.StackSummary) -> traceback.StackSummary:
    return traceback.StackSummary.from_list(
        [f for f in stack if not os.path.abspath(f.filename).startswith(_NOT_THE_PROGRAMS)])


def users_traceback(exc: BaseException) -> str:
    """`exc` formatted as Python's top-level handler prints it, the auditor's frames left out (a
    traceback with none of the program's frames is the exception's line alone, as Python prints
    an error raised where no frame of the program was running)."""
    te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    seen: set[int] = set()
    t: traceback.TracebackException | None = te
    while t is not None and id(t) not in seen:  # (the chain: __cause__ or __context__, each filtered)
        seen.add(id(t))
        t.stack = _programs(t.stack)
        t = t.__cause__ or (None if t.__suppress_context__ else t.__context__)
    return "".join(te.format())


def print_users_traceback(exc: BaseException) -> None:
    """As Python prints what ended a program: nothing for sys.exit (its message is echoed where it
    is caught) or for the interrupts the audit raises itself (StepsDone at --steps, Terminated for
    a SIGTERM, which kills a plain run without a word: subclasses of KeyboardInterrupt); a plain
    KeyboardInterrupt (a Ctrl-C) and any error printed. Best effort: it must not change how the run ends."""
    if isinstance(exc, SystemExit) or (isinstance(exc, KeyboardInterrupt) and type(exc) is not KeyboardInterrupt):
        return
    try:
        text = users_traceback(exc)
        sys.stderr.write(text)
        sys.stderr.flush()
    except Exception:
        pass
