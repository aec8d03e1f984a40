"""The auditor's own work in the user's process, kept out of what the user's program can observe.

An audited program must behave as it does without the audit. Where it would otherwise see the
auditor at work:
* torch-function modes (the user's, `set_default_device`'s) would see, pay for or refuse the
  auditor's reads of the user's tensors: those run with dispatch off (`no_torch_function`).
* the warnings registry is forgotten whenever the filters change: nothing here changes them while
  the program runs; `recorded_warnings` catches a call's warnings without doing so.
* a warning torch raises inside a call the auditor passes on is shown at the user's line that made
  the call (`warnings_name_the_user`).
* torch.compile: a hook dynamo traces into the user's graph only notes that it ran (`TracedCalls`),
  and is read after the compiled code has run; our frames after a graph break are not compiled
  (`dynamo_skips_our_frames`); the numerics mode is off the stack for compiled calls
  (`compiled_calls_without`) and the rehearsal is told of their results (`compiled_call_results`).
* the program's own trace function (sys.settrace) does not see the auditor's one-time work there
  (`untraced`); its hot paths make few calls.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
from typing import Any, Callable, Iterator

import torch

import auditor
from auditor.capture import torch_private
from auditor.capture.frames import user_frame

# Torch-function dispatch off, for modes and tensor subclasses alike: a C context manager, cheap
# enough for the paths every checked call takes.
no_torch_function = torch._C.DisableTorchFunction


@contextlib.contextmanager
def recorded_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """Every warning raised in the block, recorded instead of shown: `catch_warnings(record=True)`
    with `simplefilter("always")`, without telling the warnings module that its filters changed
    (which makes Python forget every warning it has shown: a warning in the user's loop, shown once
    in a plain run, would be shown again after each of the auditor's catches). The filters list is
    swapped in place and put back; with "always" nothing is remembered in the meantime.

    Under Python 3.14's context-aware warnings the filters live in a context variable: there
    `catch_warnings` is used as it is."""
    if getattr(sys.flags, "context_aware_warnings", False):  # pragma: no cover - Python >= 3.14
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield caught
        return
    caught: list[warnings.WarningMessage] = []

    def record(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        caught.append(warnings.WarningMessage(message, category, filename, lineno, file, line))

    filters, show = warnings.filters[:], warnings.showwarning
    warnings.filters[:] = [("always", None, Warning, None, 0)]
    warnings.showwarning = record
    try:
        yield caught
    finally:
        warnings.filters[:] = filters
        warnings.showwarning = show



class _Notes:
    """The attributes dynamo stores into for `TracedCalls.note` (nothing else lives here)."""


_NOTE_SITES: list[Any] = []  # a note's number -> the user's line of the compiled call it was traced in


_AUDITOR_DIR = os.path.normcase(os.path.realpath(os.path.dirname(auditor.__file__))) + os.sep


def _ours(filename: str) -> bool:
    return os.path.normcase(os.path.realpath(filename)).startswith(_AUDITOR_DIR)


def _relocated(filename: str, lineno: int, line: Any, frame: Any) -> tuple[str, int, Any]:
    """(file, line, source) a warning is shown at: the user's line below `frame` on the stack when
    the warning names one of the auditor's files, else as it came."""
    if filename and _ours(filename):
        where = user_frame(frame)
        if where is not None and not _ours(where[0]):
            return where[0], where[1], None
    return filename, lineno, line


def warnings_name_the_user() -> None:
    """Show each warning that names one of the auditor's files at the user's line below it on the
    stack instead (the warning and its filters are untouched; only where it is shown changes).
    Both warnings.showwarning and warnings.formatwarning are wrapped: a program that replaces
    showwarning later (logging.captureWarnings, a framework's handler) still formats through
    formatwarning, which the warning's stack reaches."""
    show, fmt = warnings.showwarning, warnings.formatwarning
    if getattr(show, "__audit_original__", None) is not None:
        return

    def showwarning(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        filename, lineno, line = _relocated(filename, lineno, line, sys._getframe(1))
        show(message, category, filename, lineno, file, line)

    def formatwarning(message: Any, category: Any, filename: str, lineno: int, line: Any = None) -> str:
        filename, lineno, line = _relocated(filename, lineno, line, sys._getframe(1))
        return fmt(message, category, filename, lineno, line)

    showwarning.__audit_original__ = show  # type: ignore[attr-defined]
    formatwarning.__audit_original__ = fmt  # type: ignore[attr-defined]
    warnings.showwarning = showwarning
    warnings.formatwarning = formatwarning


def _note_name() -> str:
    """Runs once, while dynamo traces a `TracedCalls.note` call (its result is a constant of the
    compiled code): a name of its own for that call, and the user's line of the call that entered
    the compiled code, found on the stack as it is then (the user's frames, then dynamo's)."""
    _NOTE_SITES.append(user_frame(sys._getframe(1)))
    return f"n{len(_NOTE_SITES) - 1}"


setattr(_note_name, torch_private.DYNAMO_CONSTANT, True)  # (torch._dynamo.assume_constant_result's mark)


class TracedCalls:
    """Calls of a hook that ran inside code torch.compile traced, noted there and read afterwards.

    Torch calls the optimizer step hooks inside the optimizer's step, so a compiled step traces
    them too. Run as they are, they would be a graph break there: `fullgraph=True` would turn it
    into an error (a program that runs without the audit would fail under it), and otherwise it
    would split the user's graph (one more graph break than a plain run counts, an optimizer step
    compiled in pieces and measured as such). Traced, a hook must not put anything of ours into the user's
    graph (its ops, and so its numbers, are the user's), nor read any value of ours that changes
    between calls: dynamo guards what it reads, and a changed value recompiles the user's function.
    So the traced hook only notes the call: `note(value)` stores `value` in an attribute named for
    that call (`_note_name`, run while dynamo traces it), a store dynamo replays after the graph
    with no guard. `take` reads the notes later, from code that runs as it is; a note the same
    compiled code makes again before that replaces the first.

    (Not a list to append to: it is guarded on its length, which recompiles the user's function
    whenever two compiled calls come between two reads of it. Not a function dynamo calls after the
    graph, `config.reorderable_logging_functions`: it is dropped when called from a traced hook, as
    every call nested in the compiled function is.)"""

    def __init__(self) -> None:
        self.notes = _Notes()

    def note(self, value: Any) -> None:
        setattr(self.notes, _note_name(), value)

    def noted(self) -> dict[str, Any]:
        """The notes' own dict (kept, cleared by `take`): empty while nothing is noted. Read only
        by code that cannot be running inside a trace (its truth would be a guard there)."""
        return vars(self.notes)

    def take(self) -> list[tuple[Any, Any]]:
        """(value, the user's line of the compiled call) of each note since the last take, in the
        order they were made."""
        d = vars(self.notes)
        if not d:
            return []
        out = [(v, _NOTE_SITES[int(k[1:])]) for k, v in d.items()]
        d.clear()
        return out


class untraced:
    """`with untraced():` the thread's trace function (sys.settrace) off inside, and back as it was
    after: what the program traces is its own code, not the auditor's work. Only around work of
    the auditor's own (a hook's body, a scan), never around a call of the program's. (A profile
    function stays: the profiler window's stack tracer is one.) A class, not a generator: the
    tracer sees one call of it (its __enter__), not four."""

    __slots__ = ("trace",)

    def __enter__(self) -> None:
        self.trace = sys.gettrace()
        if self.trace is not None:
            sys.settrace(None)

    def __exit__(self, *exc: Any) -> None:
        if self.trace is not None:
            sys.settrace(self.trace)


def quietly(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) untraced, for a hook's body run on every call: straight through when the thread
    has no trace function (one C call's test)."""
    if sys.gettrace() is None:
        return fn(*args)
    with untraced():
        return fn(*args)


def programs_profiler(notes: list[str]) -> bool:
    """Whether the program has a profile function of its own (sys.setprofile, threading.setprofile):
    torch's stack tracer would replace it on every thread for the profiler window (and leave none
    after), so the window records no Python stacks; `notes` gets why, once."""
    import threading

    if sys.getprofile() is None and getattr(threading, "_profile_hook", None) is None:
        return False
    if PROFILE_NOTE not in notes:
        notes.append(PROFILE_NOTE)
    return True


PROFILE_NOTE = ("the program has a profile function of its own (sys.setprofile): the profiler window recorded "
                "no Python stacks, whose tracer would have replaced it (the trace names no lines of the program's)")


def threads_end_quietly(kind: type, ending: Callable[[], bool]) -> Callable[[], None]:
    """A `kind` the audit raised to end the program (StepsDone), raised on a thread of the program's
    while `ending()`, ends that thread without a word, as it ends the main thread: Python's
    threading.excepthook would print it with its traceback. Any other exception reaches the hook as
    before. Returns the undo (which leaves a hook the program set since alone)."""
    import threading

    before = threading.excepthook

    def excepthook(args: Any) -> None:
        if not (isinstance(args.exc_value, kind) and ending()):
            before(args)

    threading.excepthook = excepthook
    return lambda: setattr(threading, "excepthook", before) if threading.excepthook is excepthook else None


_DYNAMO_TOLD = [False]  # whether dynamo was told to leave our frames alone


def dynamo_skips_our_frames() -> None:
    """torch.compile runs the Python that follows a graph break eagerly, with its frame hook on:
    the auditor's code run there (the numerics mode's `__torch_function__` for each torch call, a
    probe on the call that broke the graph: `loss.backward()` in a compiled function) would be
    compiled as frames of its own, and recompiled for every new float argument until dynamo's
    recompile limit (warnings naming the auditor, steps up to 30x slower than without the audit;
    graph breaks in the auditor's frames the plain run does not count). So every code object of the capture package
    is marked to be run as it is (that frame only: the user's code it calls is compiled as before).
    Called before each step, it acts once dynamo is imported (importing it costs ~2 s). Inlining,
    when dynamo traces a call of ours, is unaffected."""
    if _DYNAMO_TOLD[0] or "torch._dynamo" not in sys.modules:
        return
    _DYNAMO_TOLD[0] = True
    _wrap_compiled_calls()
    try:
        from torch._dynamo.eval_frame import skip_code
    except ImportError:  # pragma: no cover - a torch without it
        return
    with untraced():
        for name, mod in list(sys.modules.items()):
            if name.startswith("auditor.capture.") and mod is not None:
                for code in _codes_in(vars(mod).values()):
                    skip_code(code)


def _codes_in(values: Any) -> list[Any]:
    """The code objects of the functions and classes among `values` (a module's namespace), with
    those nested in them (closures: the probes' wrappers)."""
    out, seen = [], set()
    stack = []
    for v in values:
        if isinstance(v, type) and v.__module__.startswith("auditor."):
            stack.extend(getattr(x, "__code__", None) for x in vars(v).values())
        else:
            stack.append(getattr(v, "__code__", None) if getattr(v, "__module__", "").startswith("auditor.") else None)
    while stack:
        c = stack.pop()
        if c is None or not hasattr(c, "co_consts") or id(c) in seen:
            continue
        seen.add(id(c))
        out.append(c)
        stack.extend(k for k in c.co_consts if hasattr(k, "co_consts"))
    return out


# torch's mode-stack primitives, without torch.overrides' Python frames (every compiled call)
_stack_len = torch._C._len_torch_function_stack
_stack_at = torch._C._get_function_stack_at
_pop_mode = torch._C._pop_torch_function_stack
_push_mode = torch._C._push_on_torch_function_stack
_compiling = torch.compiler.is_compiling


class _ModeOff:
    """What compiled_calls_without was given, and its state."""

    mode: Any = None  # the mode compiled code must not find on the stack (the numerics mode)
    starts: Callable[[tuple, dict], Any] | None = None  # told of each compiled call before it
    ran: Callable[[Any, tuple, dict, Any, Any, Any], None] | None = None  # and after it
    results: Callable[[Any, tuple, dict, Any], None] | None = None  # told of each compiled call's result
    config: Any = None  # torch._dynamo.config, once the entry is wrapped
    wrapped = False  # whether the entry is wrapped (or found missing)
    running = 0  # calls of compiled code running that took the mode off


_OFF = _ModeOff()


def compiled_calls_without(mode: Any, starts: Callable[[tuple, dict], Any],
                           ran: Callable[[Any, tuple, dict, Any, Any, Any], None]) -> None:
    """Take `mode` (the numerics collector's, on the stack for the whole step) off the
    torch-function mode stack for each call of code torch.compile compiled: `torch.compile(fn)`,
    `@torch.compile`, `torch.compile(model)` and `model.compile()`, `torch._dynamo.optimize`.
    `token = starts(args, kwargs)` is called before such a call, and `ran(compiled, args, kwargs,
    result, frame, token)` after it if it returned, with the mode back, from the frame of its
    caller.

    Dynamo traces a compiled frame through the modes on the stack when it starts, and guards on
    them: with ours there, the user's graph would be made of the calls our mode passes on, not of
    theirs (`0.37 / t` traced as `t.reciprocal() * 0.37`: 5 calls captured for a plain run's 4),
    `.item()` in compiled code would print another warning than a plain run's, and a function
    compiled at import (no mode on the stack) would be compiled again in the steps (its mode-stack
    guard fails: 4 graph breaks for 2). The entry wrapped is the function
    `_TorchDynamoContext.__call__` returns, the one that sets dynamo's frame callback and then
    calls the user's function; a compiled call nested in it finds the mode gone and leaves the
    stack as it is. A mode of the user's entered in the step (above ours) stays where it is.

    What this costs the checks: the calls inside compiled code are not checked one by one in any
    case (the mode passes traced calls on, and inductor's kernels are no torch calls), but what
    dynamo runs eagerly inside a compiled call (the code after a graph break, a
    `torch.compiler.disable`d function, the graph itself on the eager backends) runs without the
    mode too. The compiled call is checked as one call instead (`starts`, `ran`), and the checks that
    need no mode stay: the loss of a backward pass run there (`in_compiled_call`), gradient norms
    and weights after each optimizer step.

    Wrapped once torch._dynamo is imported: at the first `torch.compile`, or at a step's start
    (`dynamo_skips_our_frames`); a function given to `torch._dynamo.optimize` before both keeps
    the mode. On a torch whose eval_frame has no such entry, nothing changes."""
    _OFF.mode, _OFF.starts, _OFF.ran = mode, starts, ran
    _wrap_compile()


def compiled_call_results(results: Callable[[Any, tuple, dict, Any], None]) -> None:
    """`results(compiled, args, kwargs, result)` after each call of compiled code that returned
    (one not made from inside other compiled code), with or without the numerics mode: the CUDA
    rehearsal's marks on the results, where dynamo did not trace its mode (rehearsal/device.py)."""
    _OFF.results = results
    _wrap_compile()


def _wrap_compile() -> None:
    """Wrap the compiled calls (`_wrap_compiled_calls`) now if dynamo is imported, else at the
    first `torch.compile`."""
    if "torch._dynamo.eval_frame" in sys.modules:
        _wrap_compiled_calls()
    orig = torch.compile
    if getattr(orig, "__audit_compile__", False):
        return

    def compile(*args: Any, **kwargs: Any) -> Any:
        if not _OFF.wrapped:
            try:
                import torch._dynamo.eval_frame  # noqa: F401  (what torch.compile imports anyway)
            except Exception:  # pragma: no cover - torch.compile says why
                pass
            _wrap_compiled_calls()
            dynamo_skips_our_frames()
        return orig(*args, **kwargs)

    functools.update_wrapper(compile, orig)
    compile.__audit_compile__ = True  # type: ignore[attr-defined]
    torch.compile = compile


def in_compiled_call() -> bool:
    """Whether a call of compiled code has taken the mode off the stack (see compiled_calls_without):
    what runs then runs without it."""
    return _OFF.running > 0


def _wrap_compiled_calls() -> None:
    """Wrap what `_TorchDynamoContext.__call__` returns for a function (torch.compile's wrapper of
    it, also made for a compiled module's forward and a compiled class's `__call__`) in
    `_without_mode`, once."""
    if _OFF.wrapped or (_OFF.mode is None and _OFF.results is None):
        return
    _OFF.wrapped = True
    try:
        from torch._dynamo.eval_frame import _TorchDynamoContext
    except ImportError:  # pragma: no cover - a torch without it: the mode stays on
        return
    make = _TorchDynamoContext.__dict__.get("__call__")
    if make is None:  # pragma: no cover
        return
    _OFF.config = torch._dynamo.config

    def __call__(self: Any, fn: Any) -> Any:
        out = make(self, fn)
        if (out is fn or isinstance(out, (type, torch.nn.Module))
                or getattr(out, "_torchdynamo_orig_callable", None) is None):
            return out  # (a compiled module, whose forward this wrapped; a class, whose __call__)
        return _without_mode(out)

    functools.update_wrapper(__call__, make)
    _TorchDynamoContext.__call__ = __call__


def _without_mode(compiled: Any) -> Any:
    """`compiled`, called with the mode taken off the stack and put back where it was after, its
    result then given to `results` when set (compiled_call_results)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        off = _OFF
        if off.results is None:
            return _call_without_mode(off, compiled, args, kwargs)
        if _compiling():
            return compiled(*args, **kwargs)
        out = _call_without_mode(off, compiled, args, kwargs)
        off.results(compiled, args, kwargs, out)
        return out

    functools.update_wrapper(call, compiled)  # (dynamo's attributes too: it inlines the user's function)
    return call


def _call_without_mode(off: _ModeOff, compiled: Any, args: tuple, kwargs: dict) -> Any:
    """A call of `compiled` from `_without_mode`'s wrapper, the mode taken off the stack for it."""
    mode = off.mode
    if mode is None:
        return compiled(*args, **kwargs)
    n = _stack_len()
    if not n or _compiling() or getattr(off.config, "disable", False):  # (TORCH_COMPILE_DISABLE=1: run eagerly)
        return compiled(*args, **kwargs)
    at = n - 1 if _stack_at(n - 1) is mode else next((i for i in range(n - 1) if _stack_at(i) is mode), None)
    if at is None:  # (off the stack: in a compiled call already, or in an optimizer step)
        return compiled(*args, **kwargs)
    token = off.starts(args, kwargs)
    if at == n - 1:  # (on top: the stack of most steps)
        above = []
        _pop_mode()
    else:
        above = [_pop_mode() for _ in range(n - 1 - at)]  # (modes the user entered in the step)
        _pop_mode()
        for m in reversed(above):
            _push_mode(m)
    off.running += 1
    try:
        out = compiled(*args, **kwargs)
    finally:
        off.running -= 1
        above = [_pop_mode() for _ in range(max(0, _stack_len() - at))]
        _push_mode(mode)
        for m in reversed(above):
            _push_mode(m)
    off.ran(compiled, args, kwargs, out, sys._getframe(2), token)  # (the wrapper's caller)
    return out
