"""Output files written whole or not at all.

Each file is written to a temporary name in its own directory, flushed to the disk, then renamed
over the old one (os.replace, atomic on one filesystem): a write that fails (a full disk, a quota)
leaves the file an earlier audit wrote as it was, never a truncated or empty one, and raises the
OSError for the caller to say what was not written.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_whole(path: Path, data: str | bytes) -> Path:
    """`data` (text as UTF-8) as the whole of `path`; OSError, with `path` unchanged, on failure."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # (what a plain open() would have made)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path
