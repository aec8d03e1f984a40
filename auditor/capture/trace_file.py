"""The profiler window's trace as the audit keeps it: `<worker>.<ns>.pt.trace.json.gz` in the run's
TensorBoard logdir (what torch-tb-profiler, `audit analyze` and every reader of a run's trace read).

The profiler exports uncompressed JSON only; that goes to a scratch file beside the trace, which
is compressed into the kept file (written whole: a temporary name, then a rename) and removed.
GZIP_LEVEL 3: a Kineto trace shrinks 13x at 1.4x level 1's time (17x at 2.3x level 6's)."""
from __future__ import annotations

import gzip
import os
import re
import time
from typing import Any, BinaryIO

from auditor.evidence.whole_files import WholeFile, make_dirs, scratch_dir

GZIP_LEVEL = 3
CHUNK = 1 << 20


def write_trace(prof: Any, out_dir: str, run_name: str, worker: str) -> str:
    """Export `prof`'s recording into the run's logdir, `out_dir/tb/run_name` (made here: no link on
    the way, auditor.evidence.whole_files), as a compressed trace written whole; its path. The
    uncompressed export goes to a scratch directory of the audit's own (export_dir), removed after."""
    logdir = str(make_dirs(out_dir, "tb", run_name))
    name = f"{worker}.{time.time_ns()}.pt.trace.json.gz"
    path = os.path.join(logdir, name)
    with scratch_dir(export_dir(logdir)) as scratch:
        export = os.path.join(scratch, name[:-3])
        prof.export_chrome_trace(export)
        with open(export, "rb") as src, WholeFile(path) as kept:
            with gzip.GzipFile(filename="", mode="wb", compresslevel=GZIP_LEVEL, fileobj=kept.file, mtime=0) as gz:
                copy_escaped(src, gz)
    return path


# Kineto writes names as they are (`"name": "<file>(<line>): <function>"` for a Python frame): a
# quote or a backslash in a file's or a function's name (`my"train.py`) breaks the JSON. A name
# line that is not a JSON string is escaped as it is copied; the others are copied untouched.
_JSON_BODY = rb'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*'
_NAME_LINE = re.compile(rb'^(\s*"name": ")(.*)(",?[ \t\r]*)$', re.M)
# (a quick test for a block: a name holding a backslash, or a quote that does not end its line)
_BAD_NAME = re.compile(rb'"name": "[^"\\\n]*(?:\\|"[^,\n\r])')
_JSON_STRING = re.compile(_JSON_BODY)


def _escaped_line(m: re.Match) -> bytes:
    body = m.group(2)
    if _JSON_STRING.fullmatch(body):
        return m.group(0)
    text = body.decode("utf-8", "surrogateescape")
    quoted = "".join(c if c not in '"\\' and c >= " " else f"\\u{ord(c):04x}" for c in text)
    return m.group(1) + quoted.encode("utf-8", "surrogateescape") + m.group(3)


def copy_escaped(src: BinaryIO, dst: Any) -> None:
    """Copy a Kineto export, each name that is not a valid JSON string escaped (_NAME_LINE): whole
    lines at a time, a block without such a name passed on as it is."""
    rest = b""
    while True:
        block = src.read(CHUNK)
        data = rest + block
        if not block:
            dst.write(_escape_names(data))
            return
        cut = data.rfind(b"\n") + 1
        rest = data[cut:]
        dst.write(_escape_names(data[:cut]))


def _escape_names(lines: bytes) -> bytes:
    return _NAME_LINE.sub(_escaped_line, lines) if _BAD_NAME.search(lines) else lines


class _Count:
    """A write-only sink that counts what it is given."""

    def __init__(self) -> None:
        self.n = 0

    def write(self, b: bytes) -> int:
        self.n += len(b)
        return len(b)

    def flush(self) -> None:
        pass


def compressed_size(prof: Any, run_dir: str) -> int:
    """Bytes `prof`'s recording would take as a kept trace (exported and compressed, nothing kept:
    the export goes to a scratch directory of the audit's own in `run_dir`, removed with whatever
    the exporter left there, its own `.tmp` on a full disk included)."""
    count = _Count()
    with scratch_dir(export_dir(run_dir)) as scratch:
        export = os.path.join(scratch, "calibration.json")
        prof.export_chrome_trace(export)
        with open(export, "rb") as src, gzip.GzipFile(filename="", mode="wb", compresslevel=GZIP_LEVEL,
                                                      fileobj=count, mtime=0) as gz:
            copy_escaped(src, gz)
    return count.n


def unsafe_for_trace(path: str) -> bool:
    """Whether Kineto would write `path` into its trace unreadably: it writes the trace's own path
    into the JSON unescaped, so a quote, a backslash or a control character in it breaks the file."""
    return any(c in '"\\' or not c.isprintable() for c in path)


def export_dir(logdir: str) -> str:
    """Where the profiler's export is made (in a scratch directory of its own, whole_files.scratch_dir)
    before it is compressed into `logdir`: `logdir`, or, when its path is unsafe for the trace
    (unsafe_for_trace), the system's temporary directory."""
    if not unsafe_for_trace(os.path.abspath(logdir)):
        return logdir
    import tempfile

    base = tempfile.gettempdir()
    return base if not unsafe_for_trace(base) else "/tmp"
