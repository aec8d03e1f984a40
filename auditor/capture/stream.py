"""The evidence stream from the child process to the parent: one JSON object per line on a pipe.

The records are the typed Structs of auditor.capture.wire. The child writes each as soon as it
exists (environment, each step, the ending), so if the child dies hard the parent still holds
every record written before. The pipe is the child's own file descriptor, never its stdout: what
the user's program prints does not mix in.
"""
from __future__ import annotations

import errno
import os
import selectors
import subprocess
import threading
import time
from typing import Any, Iterable, Iterator

import msgspec

from auditor.capture import own_fds, this_process, wire

READ_PAUSE_S = 0.05  # the reader's pause between reads (see read_chunks)


class Writer:
    """The child's end of the evidence pipe. The program may close it (os.closerange) and reuse its
    number: each record is written only while the descriptor is still the pipe (own_fds), and the
    pipe is opened again through the parent's end of it (`parent`, its pid) when it is not."""

    def __init__(self, fd: int, parent: int | None = None) -> None:
        self.fd = fd
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.key = own_fds.identity(fd)
        self.parent = parent

    def send(self, record: wire.Record) -> None:
        if this_process.PID != self.pid:  # a forked DataLoader worker inherited the pipe: stay silent
            return
        try:
            data = wire.encode(record)
        except UnicodeEncodeError:  # a path that is not UTF-8 (undecodable bytes kept as surrogates)
            data = msgspec.json.encode(_utf8(msgspec.to_builtins(record))) + b"\n"
        with self.lock:
            if not own_fds.still(self.fd, self.key) and not self._reopen():
                return  # (no way back to the parent: the records are lost, the program goes on)
            view = memoryview(data)
            try:
                while view:
                    n = os.write(self.fd, view)
                    view = view[n:]
            except BrokenPipeError:  # the parent is gone: nobody is left to report to
                os._exit(3)

    def _reopen(self) -> bool:
        fd = own_fds.reopen_pipe(self.key, self.parent) if self.key is not None else None
        if fd is None:
            self.key = None  # (given up: never written to again)
            return False
        self.fd = fd
        return True


def _utf8(obj: Any) -> Any:
    """obj with every string made valid UTF-8 (undecodable bytes become U+FFFD)."""
    if isinstance(obj, str):
        return obj.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    if isinstance(obj, dict):
        return {_utf8(k): _utf8(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_utf8(v) for v in obj]
    return obj


def split_lines(chunks: Iterable[bytes], redraws: bool = False) -> Iterator[bytes]:
    """Complete lines (with their newline) of a stream of chunks, as they complete. A torn last
    line (the writer died mid-write) is dropped, unless `redraws`: then text ending in \r (a
    progress bar redrawn in place) comes out as it arrives, and so does what is left at the end."""
    rest = b""
    for chunk in chunks:
        *lines, rest = (rest + chunk).split(b"\n")
        for line in lines:
            yield line + b"\n"
        cut = rest.rfind(b"\r") + 1 if redraws else 0
        if cut:
            yield rest[:cut]
            rest = rest[cut:]
    if redraws and rest:
        yield rest


def read_records(chunks: Iterable[bytes]) -> Iterator[tuple[wire.Record, bytes]]:
    """(record, raw line) for each complete line in a stream of chunks (see split_lines); a line
    that is not a record of auditor.capture.wire is skipped."""
    for line in split_lines(chunks):
        try:
            yield wire.DECODER.decode(line), line
        except msgspec.DecodeError:
            continue


def read_chunks(fd: int, proc: subprocess.Popen, pause_s: float = READ_PAUSE_S) -> Iterator[bytes]:
    """What the child writes to the pipe `fd`, until the child has exited and the pipe is drained.

    Not until end-of-file: a process the user's code forked (a data server, a metrics daemon)
    inherits the pipe's write end and may hold it open long after the child is gone. After each
    read it pauses `pause_s`, so that several records come in one read: the child's per-step
    write then seldom has to wake this process, whose CPU the training needs on a small machine.
    The pause ends at once when the child (`proc`) exits (Linux: a pidfd), so its end is seen
    when it happens (the ranks of a failed job are ordered by when each ended)."""
    os.set_blocking(fd, False)
    exit_fd = _pidfd(proc.pid)
    with selectors.DefaultSelector() as sel, selectors.DefaultSelector() as pause:
        sel.register(fd, selectors.EVENT_READ)
        if exit_fd is not None:
            sel.register(exit_fd, selectors.EVENT_READ)
            pause.register(exit_fd, selectors.EVENT_READ)
        try:
            while True:
                gone = proc.poll() is not None  # (before the read: all the child wrote is in the pipe by then)
                sel.select(timeout=0.25)
                data, eof = _read_available(fd)
                if data:
                    yield data
                if eof or gone:
                    return
                if data and exit_fd is not None:
                    pause.select(timeout=pause_s)
                elif data:
                    time.sleep(pause_s)
        finally:
            if exit_fd is not None:
                os.close(exit_fd)


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # (not Linux >= 5.3: the pause runs its course)
        return None


def _read_available(fd: int) -> tuple[bytes, bool]:
    parts = []
    while True:
        try:
            b = os.read(fd, 1 << 20)
        except BlockingIOError:
            return b"".join(parts), False
        except OSError as e:  # a pseudo-terminal's reader, once no process holds the terminal: EIO
            if e.errno != errno.EIO:
                raise
            b = b""
        if not b:
            return b"".join(parts), True
        parts.append(b)


def widen_pipe(fd: int, size: int = 1 << 20) -> None:
    """Room for many records in the pipe (Linux), so the child's writes do not wait for reads."""
    try:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, size)
    except (ImportError, AttributeError, OSError):
        pass
