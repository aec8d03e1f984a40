"""Every file the audit writes under an output directory: written whole, never through a link.

The rules every writer here follows (the one place that opens a file for writing under --out):
- a file is created by the call that writes it (O_CREAT|O_EXCL|O_NOFOLLOW): never an existing
  file, never the target of a symbolic link someone planted at its name; an output is written to
  such a temporary name in its own directory, flushed, then renamed over the old one (os.replace,
  atomic on one filesystem, which replaces a link rather than writing where it points): a write
  that fails (a full disk, a quota) leaves the file an earlier audit wrote as it was and raises
  the OSError for the caller to say what was not written;
- an output's name that is a symbolic link is refused (LinkRefused), and so is a directory on the
  way to it under the output directory (make_dirs): in a shared directory, another user's link
  would make the audit overwrite a file of theirs choosing;
- the directory is held open while a file is written in it (dir_fd): one swapped for a link
  meanwhile changes nothing;
- a file kept at a fixed name across audits (the lock) is opened without following a link, and
  only when it is a regular file of one name (open_kept).
Files a library writes by name (the profiler's export) go into a directory of the audit's own,
made private by this process (scratch_dir), and are removed with it.
"""
from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Iterator

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_AT = {os.open, os.replace, os.unlink, os.stat} <= os.supports_dir_fd  # (Linux, macOS: yes)


class LinkRefused(OSError):
    """A name the audit writes is a symbolic link (or a directory on the way to it is)."""

    def __init__(self, path: str | Path) -> None:
        target = ""
        with contextlib.suppress(OSError):
            target = f" (to {os.readlink(path)})"
        super().__init__(errno.ELOOP, f"a symbolic link{target}: the audit never writes through one", str(path))

    def __str__(self) -> str:
        return f"{self.filename} is {self.strerror}"


def refuse_link(path: str | Path) -> None:
    """LinkRefused when `path` is a symbolic link."""
    if os.path.islink(path):
        raise LinkRefused(path)


def temp_name(name: str) -> str:
    """A temporary name beside `name` that says whose it is: `.NAME.PID.RANDOM.tmp`."""
    return f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def open_new(path: str | Path, mode: int = 0o666) -> int:
    """A descriptor for writing a new file at `path`, created by this call (FileExistsError for an
    existing name, a link included); its mode is `mode` less the umask, as open() makes it."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, mode)


def open_kept(path: str | Path) -> int:
    """A read-write descriptor for a file kept at a fixed name (made when missing): never through a
    link (LinkRefused), only a regular file with one name (not a device, a FIFO, a hard link to
    another file: OSError)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | NOFOLLOW | CLOEXEC | getattr(os, "O_NONBLOCK", 0), 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP or os.path.islink(path):
            raise LinkRefused(path) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise OSError(errno.EEXIST, "not a regular file of its own (another file's hard link?)", str(path))
    return fd


def make_dirs(base: str | Path, *parts: str) -> Path:
    """base/parts..., each part made when missing; LinkRefused when one is a symbolic link (`base`
    itself is the user's to choose)."""
    path = Path(base)
    for part in parts:
        path = path / part
        try:
            os.mkdir(path)
        except FileExistsError:
            pass
        if os.path.islink(path):
            raise LinkRefused(path)
        if not path.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))
    return path


class WholeFile:
    """A file written whole: bytes go to a temporary file made beside `path` (open_new, in the
    directory held open), which commit() flushes, syncs and renames over `path`; discard() (or an
    exception in a `with` block) removes it, leaving `path` as it was. `publish()` renames it
    early and goes on appending (a stream others read as it grows: records.jsonl)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.name = self.path.name
        self.tmp = temp_name(self.name)
        self.published = False
        # (O_PATH: a directory the audit may write in but not list is still held)
        self._dir = os.open(self.path.parent, getattr(os, "O_PATH", os.O_RDONLY) | DIRECTORY | CLOEXEC) if _AT else None
        try:
            self._refuse_link()
            fd = self._open_new()
        except BaseException:
            self._close_dir()
            raise
        self.file = os.fdopen(fd, "wb")

    def _at(self, name: str) -> str | Path:
        return name if self._dir is not None else self.path.parent / name

    def _open_new(self) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC
        if self._dir is not None:
            return os.open(self.tmp, flags, 0o666, dir_fd=self._dir)
        return open_new(self.path.parent / self.tmp)

    def _refuse_link(self) -> None:
        try:
            st = os.stat(self._at(self.name), dir_fd=self._dir, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            raise LinkRefused(self.path)

    def _rename(self) -> None:
        self._refuse_link()
        os.replace(self._at(self.tmp), self._at(self.name), src_dir_fd=self._dir, dst_dir_fd=self._dir)

    def write(self, data: bytes) -> None:
        self.file.write(data)

    def publish(self) -> None:
        """`path` is this file from now on (the writes after go on into it)."""
        if not self.published:
            self.file.flush()
            self._rename()
            self.published = True

    def commit(self, sync: bool = True) -> Path:
        try:
            self.file.flush()
            if sync:
                os.fsync(self.file.fileno())
            self.file.close()
            if not self.published:
                self._rename()
                self.published = True
        except BaseException:
            self.discard()
            raise
        self._close_dir()
        return self.path

    def discard(self) -> None:
        """Close and remove what was written (`path` itself once published)."""
        with contextlib.suppress(OSError):
            self.file.close()
        with contextlib.suppress(OSError):
            os.unlink(self._at(self.name if self.published else self.tmp), dir_fd=self._dir)
        self._close_dir()

    def _close_dir(self) -> None:
        if self._dir is not None:
            with contextlib.suppress(OSError):
                os.close(self._dir)
            self._dir = None

    def __enter__(self) -> "WholeFile":
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.commit()
        else:
            self.discard()


def write_whole(path: Path, data: str | bytes) -> Path:
    """`data` (text as UTF-8) as the whole of `path`; OSError, with `path` unchanged, on failure."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    with WholeFile(path) as f:
        f.write(raw)
    return path


def probe_writable(directory: Path) -> None:
    """OSError when a file cannot be made in `directory` (one is made and removed)."""
    probe = directory / temp_name("audit-write-test")
    os.close(open_new(probe))
    os.unlink(probe)


@contextlib.contextmanager
def scratch_dir(parent: str | Path | None) -> Iterator[str]:
    """A directory of this process's own (made by this call, mode 0700: nothing in it can have been
    planted) in `parent` (None: the system's temporary directory), removed with all it holds."""
    path = tempfile.mkdtemp(prefix=f".audit-scratch-{os.getpid()}-", dir=parent)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def leftovers(directory: str | Path, pid: int) -> list[Path]:
    """What process `pid` left of its temporary files (temp_name) and scratch directories
    (scratch_dir) in `directory`: it was stopped before it removed them."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(Path(directory, n) for n in names
                  if (n.startswith(".") and n.endswith(".tmp") and f".{pid}." in n)
                  or n.startswith(f".audit-scratch-{pid}-"))


def remove_leftover(path: Path) -> None:
    """Remove a leftover file or scratch directory (never through a link)."""
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()
