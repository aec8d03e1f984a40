"""The profiler window's trace as the audit keeps it: `<worker>.<ns>.pt.trace.json.gz` in the run's
TensorBoard logdir (what torch-tb-profiler, `audit analyze` and every reader of a run's trace read).

The profiler exports uncompressed JSON only; that goes to a scratch file beside the trace, which
is compressed into the kept file (written whole: a temporary name, then a rename) and removed.
GZIP_LEVEL 3: a Kineto trace shrinks 13x at 1.4x level 1's time (17x at 2.3x level 6's)."""
from __future__ import annotations

import gzip
import os
import shutil
import time
from typing import Any

GZIP_LEVEL = 3
CHUNK = 1 << 20


def write_trace(prof: Any, logdir: str, worker: str, scratch_dir: str | None = None) -> str:
    """Export `prof`'s recording into `logdir` as a compressed trace; its path. The uncompressed
    export goes to `scratch_dir` (default: `logdir`)."""
    os.makedirs(logdir, exist_ok=True)
    name = f"{worker}.{time.time_ns()}.pt.trace.json.gz"
    path = os.path.join(logdir, name)
    scratch = os.path.join(scratch_dir or logdir, name[:-3] + ".partial")
    try:
        prof.export_chrome_trace(scratch)
        with open(scratch, "rb") as src, open(path + ".partial", "wb") as raw:
            with gzip.GzipFile(filename="", mode="wb", compresslevel=GZIP_LEVEL, fileobj=raw, mtime=0) as gz:
                shutil.copyfileobj(src, gz, CHUNK)
        os.replace(path + ".partial", path)
    finally:
        for leftover in (scratch, path + ".partial"):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return path


class _Count:
    """A write-only sink that counts what it is given."""

    def __init__(self) -> None:
        self.n = 0

    def write(self, b: bytes) -> int:
        self.n += len(b)
        return len(b)

    def flush(self) -> None:
        pass


def compressed_size(prof: Any, scratch_dir: str) -> int:
    """Bytes `prof`'s recording would take as a kept trace (exported and compressed, nothing kept)."""
    os.makedirs(scratch_dir, exist_ok=True)
    scratch = os.path.join(scratch_dir, f".calibration.{os.getpid()}.json")
    count = _Count()
    try:
        prof.export_chrome_trace(scratch)
        with open(scratch, "rb") as src, gzip.GzipFile(filename="", mode="wb", compresslevel=GZIP_LEVEL,
                                                       fileobj=count, mtime=0) as gz:
            shutil.copyfileobj(src, gz, CHUNK)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    return count.n


def unsafe_for_trace(path: str) -> bool:
    """Whether Kineto would write `path` into its trace unreadably: it writes the trace's own path
    into the JSON unescaped, so a quote, a backslash or a control character in it breaks the file."""
    return any(c in '"\\' or not c.isprintable() for c in path)


def export_dir(logdir: str) -> str:
    """Where the profiler exports its trace before it is compressed into `logdir`: `logdir`, or,
    when its path is unsafe for the trace (unsafe_for_trace), a temporary directory of the audit's
    own choosing (removed once the trace is kept)."""
    if not unsafe_for_trace(os.path.abspath(logdir)):
        return logdir
    import tempfile

    base = tempfile.gettempdir()
    return tempfile.mkdtemp(prefix="audit-trace-", dir=None if not unsafe_for_trace(base) else "/tmp")
