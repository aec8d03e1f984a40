"""Which source files the audit may read to quote a line: only those under the roots the user's
code is in.

A recording (a profiler trace, a memory snapshot, another machine's evidence.json) names files by
whatever paths it holds: `/etc/passwd`, `../../secrets`, a name that a symlink leads out of the
project. Reading those and quoting them would copy this machine's files into reports that are
shared. So every source read of the rules and the reports goes through this module:

- `allow(roots)` sets the roots for this process (the command line does: `audit run`, the
  audited project's roots; `audit analyze`, the `--source-root` directories and a saved run's
  recorded roots; none at all when nothing names one);
- a file is read only when its real path (symlinks and `..` resolved) is under a root's real
  path; a relative name is looked up from the current directory and the roots only, never in this
  machine's site-packages (where another version than the recording's may be installed: source
  of installed packages is not quoted from recordings at all);
- a file it will not read reads as empty: the frame is shown by its path and line alone.

Before `allow` is called (the library used directly, the tests) reads are unrestricted, a
relative name found as Python's linecache finds it. `allow` also sets AUDITOR_SOURCE_ROOTS, so the
processes this one starts (the local engine's workers reducing a job's ranks) read under the same
roots.
"""
from __future__ import annotations

import contextlib
import functools
import json
import linecache
import os
from pathlib import Path
from typing import Iterable, Iterator

_roots: tuple[str, ...] | None = None  # real paths, each ending in os.sep; None: unrestricted
_found: dict[str, str | None] = {}  # name as given -> the real path read (None: not readable)
ENV = "AUDITOR_SOURCE_ROOTS"  # a JSON list of the roots, for the processes this one starts


@functools.lru_cache(maxsize=1024)
def holds_distributions(directory: str) -> bool:
    """Whether `directory` holds installed distributions (a `*.dist-info` directory): site-packages,
    or a `pip install --target DIR` directory, wherever it is. Code under one is a library's."""
    try:
        with os.scandir(directory) as entries:
            return any(e.name.endswith(".dist-info") and e.is_dir() for e in entries)
    except OSError:
        return False


def allow(roots: Iterable[str | Path] | None) -> None:
    """Read source only under `roots` from now on (None: anywhere, the library default)."""
    global _roots
    _found.clear()
    roots = None if roots is None else [str(r) for r in roots]
    if roots is None:
        _roots = None
        os.environ.pop(ENV, None)
        return
    real = []
    for r in roots:
        if not r or "\0" in r:
            continue
        p = os.path.realpath(r)
        if os.path.isdir(p):
            real.append(p.rstrip(os.sep) + os.sep)
    _roots = tuple(dict.fromkeys(real))
    os.environ[ENV] = json.dumps(roots)


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """The roots as they are now, set again on leaving (a command run in this process, as the
    tests run them, restricts only itself)."""
    global _roots
    before, env = _roots, os.environ.get(ENV)
    try:
        yield
    finally:
        _roots = before
        _found.clear()
        if env is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = env


def _under(real: str) -> bool:
    return any(real.startswith(r) for r in _roots or ())


def under_roots(path: str | Path) -> bool:
    """Whether the file at `path` (its real path) lies under the roots (any file, before `allow`)."""
    return _roots is None or _under(os.path.realpath(path))


def resolve(file: str) -> str | None:
    """The path to read `file` at, None when the audit may not read it (or it names nothing)."""
    if not file or file.startswith("<") or "\0" in file:
        return None
    if _roots is None:
        return file
    if file in _found:
        return _found[file]
    found = None
    # (a relative name: from the current directory, as the program named it, then from each root;
    # whichever it is, the file read must be under a root)
    try:
        here = [os.getcwd()]
    except OSError:  # (the current directory was removed)
        here = []
    candidates = [file] if os.path.isabs(file) else [os.path.join(r, file) for r in (*here, *_roots)]
    for c in candidates:
        try:
            real = os.path.realpath(c)
        except (OSError, ValueError):
            continue
        if _under(real) and os.path.isfile(real):
            found = real
            break
    _found[file] = found
    return found


def readable(file: str) -> bool:
    return resolve(file) is not None


def getlines(file: str) -> list[str]:
    """The file's lines (with their endings), [] when it may not or cannot be read."""
    path = resolve(file)
    if path is None:
        return []
    return linecache.getlines(path)


def getline(file: str, line: int) -> str:
    """Line `line` of the file (with its ending), '' when it may not or cannot be read."""
    lines = getlines(file)
    return lines[line - 1] if 0 < line <= len(lines) else ""


def open_binary(file: str):
    """The file opened for reading bytes; OSError when it may not or cannot be read."""
    path = resolve(file)
    if path is None:
        raise PermissionError(f"{file}: not under the source roots")
    return open(path, "rb")


def _inherit() -> None:
    """The roots of the process that started this one (AUDITOR_SOURCE_ROOTS), if it set any."""
    text = os.environ.get(ENV)
    if text is None:
        return
    try:
        given = json.loads(text)
    except ValueError:
        given = []
    allow([r for r in given if isinstance(r, str)] if isinstance(given, list) else [])


_inherit()
