"""Finding the user's line: the first stack frame outside torch, the auditor and installed packages.

Called on every probed API call, so it caches per-file verdicts and walks raw frames only.
"""
from __future__ import annotations

import itertools
import os
import stat
import sys
import sysconfig
from types import CodeType, FrameType
from typing import Callable

import torch

import auditor
from auditor.evidence.source_access import holds_distributions

_LIBRARY_DIRS = tuple(
    os.path.normcase(os.path.realpath(p)) + os.sep
    for p in {
        os.path.dirname(torch.__file__),
        os.path.dirname(auditor.__file__),
        sysconfig.get_paths()["stdlib"],
        sysconfig.get_paths()["purelib"],
        sysconfig.get_paths()["platlib"],
    }
)
_TORCH_AND_AUDITOR = tuple(
    os.path.normcase(os.path.realpath(os.path.dirname(m.__file__))) + os.sep for m in (torch, auditor)
)
_verdict: dict[str, bool] = {}
_internal: dict[str, bool] = {}
library_verdicts = _verdict  # is_library's answers by file name, for a caller that reads them inline


def _generated(path: str) -> bool:
    """Whether `path` (normalised) is code torch.compile generated: inductor writes it to its cache
    directory, which it puts in TORCHINDUCTOR_CACHE_DIR when it first needs it (before any runs).
    Its calls are torch's, not the user's."""
    d = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return bool(d) and path.startswith(os.path.normcase(os.path.realpath(d)) + os.sep)


_real_dirs: dict[str, str] = {}  # an absolute directory -> its real path (see _real)
_normcase = os.path.normcase if os.name == "nt" else os.fspath  # (posix's normcase is fspath, in Python)


def _real(filename: str) -> str:
    """os.path.normcase(os.path.realpath(filename)), each absolute directory resolved once, from
    its parent (one lstat a new directory): a realpath is dozens of Python calls, and one per new
    file was thousands of calls for a trace function of the program's (sys.settrace) to see."""
    head, _, tail = filename.rpartition(os.sep)
    if not head or not filename.startswith(os.sep) or tail in ("", ".", ".."):
        return _normcase(os.path.realpath(filename))
    try:
        if stat.S_ISLNK(os.lstat(filename).st_mode):  # (the file itself a link: resolved whole)
            return _normcase(os.path.realpath(filename))
    except OSError:
        pass
    d = _real_dir(head)
    return _normcase(d + os.sep + tail if d != os.sep else d + tail)


def _real_dir(head: str) -> str:
    """os.path.realpath(head), for an absolute directory."""
    d = _real_dirs.get(head)
    if d is None:
        parent, _, name = head.rpartition(os.sep)
        if not parent or name in ("", ".", ".."):
            d = os.path.realpath(head)
        else:
            base = _real_dir(parent)
            try:
                link = stat.S_ISLNK(os.lstat(head).st_mode)
            except OSError:
                link = False
            d = os.path.realpath(head) if link else (base if base != os.sep else "") + os.sep + name
        _real_dirs[head] = d
    return d


def is_library(filename: str) -> bool:
    """True for frames that are not the user's own code (torch, the auditor, stdlib, site-packages
    and Debian's dist-packages, and packages imported from a directory of installed distributions
    elsewhere: a `pip install --target DIR` put on PYTHONPATH)."""
    v = _verdict.get(filename)
    if v is None:
        if filename.startswith("<"):
            v = True
        else:
            path = _real(filename)
            v = (path.startswith(_LIBRARY_DIRS) or "site-packages" in path or "dist-packages" in path
                 or _generated(path) or _from_install_dir(path))
        _verdict[filename] = v
    return v


def _from_install_dir(path: str) -> bool:
    """Whether the import path entry `path` lies under (the longest of sys.path's that holds it)
    holds installed distributions (source_access.holds_distributions), as pip's `--target DIR`
    makes one. The script's own directory is never taken for one: only a package below an entry
    counts."""
    entries = [e for e in _real_path_entries() if path.startswith(e + os.sep) and os.path.dirname(path) != e]
    return bool(entries) and holds_distributions(max(entries, key=len))


_path_entries: list = [None, ()]  # [sys.path as last seen, its entries' real paths]


def _real_path_entries() -> tuple[str, ...]:
    """sys.path's entries as real paths, resolved again only when sys.path changes."""
    if _path_entries[0] != sys.path:
        _path_entries[:] = [list(sys.path), tuple(os.path.normcase(os.path.realpath(p or ".")) for p in sys.path)]
    return _path_entries[1]


def is_torch_internal(filename: str) -> bool:
    """True for torch's and the auditor's own files, and the code torch.compile generated: calls
    made there are not the user's calls."""
    v = _internal.get(filename)
    if v is None:
        path = _real(filename)
        v = path.startswith(_TORCH_AND_AUDITOR) or _generated(path)
        _internal[filename] = v
    return v


# id(code object) -> 0 user, 1 library, 2 torch or auditor (library too). Keyed by id: hashing a
# code object hashes its contents (~0.5 us for Module._call_impl), on every frame of every walk.
# The code objects are kept in _KEPT, so an id is never reused for another one.
code_kinds: dict[int, int] = {}
_KEPT: list[CodeType] = []


def _kind_of(code) -> int:
    k = code_kinds.get(id(code))
    if k is None:
        name = code.co_filename
        k = 0 if not is_library(name) else 2 if is_torch_internal(name) else 1
        _KEPT.append(code)
        code_kinds[id(code)] = k
    return k


def forget_codes() -> None:
    """Let go of the code objects kept for code_kinds, at the program's end (after its own atexit
    handlers, before Python tears its modules down). Kept until this module's teardown, the code
    dynamo made for a compiled function outlived torch._dynamo.utils's globals, and torch 2.14's
    clean-up hook for it printed "Exception ignored in ... _remove_id ... AttributeError" on the
    user's stderr, where a plain run prints nothing. The other caches keyed by code objects
    (on_forget) are let go with them."""
    code_kinds.clear()
    _KEPT.clear()
    _via_names.clear()
    for clear in _FORGET:
        clear()


_FORGET: list[Callable[[], None]] = []


def on_forget(clear: Callable[[], None]) -> None:
    """`clear()`, which lets go of another cache of code objects, called by forget_codes."""
    _FORGET.append(clear)


def library_code(code) -> bool:
    """is_library for a code object, cached per code object (cheaper than by file name)."""
    k = code_kinds.get(id(code))
    return (k if k is not None else _kind_of(code)) != 0


def user_frame(frame: FrameType | None) -> tuple[str, int, str] | None:
    """(file, line, function) of the first user frame at or above `frame`; falls back to the first
    frame outside torch and the auditor when the whole stack is library code (e.g. a framework)."""
    w = user_call(frame)
    return w[:3] if w is not None and len(w) > 3 else w


def user_place(frame: FrameType | None) -> tuple[tuple[str, int, str] | None, FrameType | None]:
    """(user_frame's key, the user's frame it was read from: None where it is the library fallback),
    for a caller that reads the frame further (probes._method_caller) without walking to it again."""
    f, fallback = _first_user(frame)
    return ((f.f_code.co_filename, f.f_lineno, f.f_code.co_name), f) if f is not None else (fallback, None)


def user_call(frame: FrameType | None) -> tuple | None:
    """(file, line, function, f_lasti) of the first user frame at or above `frame` (user_frame,
    plus the offset of the instruction running in the user's frame (f_lasti):
    two calls on one line (`torch.log(p)` and `torch.log(1 - p)`) are two places, and only the
    one that made a NaN should be blamed and patched. A library fallback has no offset."""
    f, fallback = _first_user(frame)
    return (f.f_code.co_filename, f.f_lineno, f.f_code.co_name, f.f_lasti) if f is not None else fallback


def _first_user(frame: FrameType | None) -> tuple[FrameType | None, tuple | None]:
    """(the first user frame at or above `frame`, or None; the (file, line, function) of the first
    frame outside torch and the auditor below it, the fallback where the whole stack is library code)."""
    fallback = None
    f = frame
    kinds = code_kinds
    while f is not None:
        code = f.f_code
        k = kinds.get(id(code))
        if k is None:
            k = _kind_of(code)
        if k == 0:
            return f, fallback
        if k == 1 and fallback is None:
            fallback = (code.co_filename, f.f_lineno, code.co_name)
        f = f.f_back
    return None, fallback


_via_names: dict[int, str] = {}


def _via_name(code: CodeType) -> str:
    n = _via_names.get(id(code))
    if n is None:
        path = code.co_filename.replace(os.sep, "/")
        for marker in ("/site-packages/", "/dist-packages/"):
            if marker in path:
                path = path.rsplit(marker, 1)[1]
                break
        else:  # (a package on PYTHONPATH: its path below the sys.path entry it was imported from)
            roots = [r.replace(os.sep, "/").rstrip("/") + "/" for r in sys.path if r]
            inner = [path[len(r):] for r in roots if path.startswith(r)]
            path = min(inner, key=len) if inner else path.rsplit("/", 1)[-1]
        n = _via_names[id(code)] = f"{path}:{getattr(code, 'co_qualname', code.co_name)}"
    return n


def library_via(frame: FrameType | None, limit: int = 8) -> str:
    """The library functions (outside torch and the auditor: a framework's, the standard
    library's) between `frame` and the first user frame above it, innermost first, joined by
    " < " ("transformers/trainer.py:Trainer._maybe_log_save_evaluate < ..."): what the user's
    line called that made the call. "" when the user's code made it itself, or no user frame is
    on the stack."""
    names: list[str] = []
    f = frame
    kinds = code_kinds
    while f is not None:
        code = f.f_code
        k = kinds.get(id(code))
        if k is None:
            k = _kind_of(code)
        if k == 0:
            return " < ".join(names[:limit])
        if k == 1:
            names.append(_via_name(code))
        f = f.f_back
    return ""


def via_data(frame: FrameType | None) -> dict[str, str]:
    """{"via": library_via(frame)}, {} when the user's code made the call: a probe's tally data, so
    a framework's calls at one user line (`trainer.train()`) are told apart by what made them."""
    via = library_via(frame)
    return {"via": via} if via else {}


def call_span(frame: FrameType | None, where: tuple) -> tuple[int, int, int, int] | None:
    """(line, end line, column, end column) of the call `where` (from user_call) names, found in
    the stack above `frame`; None on Python 3.10 (no co_positions) or when it is not there."""
    if len(where) < 4:
        return None
    f = frame
    while f is not None:
        code = f.f_code
        if f.f_lasti == where[3] and code.co_filename == where[0] and code.co_name == where[2]:
            return call_position(code, f.f_lasti)
        f = f.f_back
    return None


def call_position(code: CodeType, lasti: int) -> tuple[int, int, int, int] | None:
    """(line, end line, column, end column) of the source of the instruction at byte offset
    `lasti` of `code` (a frame's f_lasti: the call it is running); None on Python 3.10 (no
    co_positions) or when Python recorded no position."""
    positions = getattr(code, "co_positions", None)
    if positions is None or lasti < 0:
        return None
    pos = next(itertools.islice(positions(), lasti // 2, None), None)  # one entry per 2-byte code unit
    return pos if pos is not None and None not in pos else None


def caller(depth: int = 2) -> FrameType | None:
    try:
        return sys._getframe(depth)
    except ValueError:
        return None
