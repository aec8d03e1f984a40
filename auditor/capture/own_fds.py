"""Descriptors the audit keeps open in the program's process (the evidence pipe, /proc files read
at every step). The program may close every descriptor it did not open (`os.closerange(3, 65536)`,
as a daemonising program does) and open files of its own at the same numbers: a descriptor of the
audit's is used only while it is still the file it was opened on (its device and inode), never a
file of the program's that took its number, and never closed once it is not."""
from __future__ import annotations

import os


def identity(fd: int) -> tuple[int, int] | None:
    """(device, inode) of the file open at `fd`, None when nothing is."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def still(fd: int, key: tuple[int, int] | None) -> bool:
    """Whether `fd` is still the file whose identity is `key`."""
    return key is not None and identity(fd) == key


def close_own(fd: int, key: tuple[int, int] | None) -> None:
    """Close `fd` if it is still the audit's."""
    if still(fd, key):
        try:
            os.close(fd)
        except OSError:
            pass


def reopen_pipe(key: tuple[int, int], holder: int | None) -> int | None:
    """A new descriptor for writing into the pipe whose identity is `key`, opened through the end
    the process `holder` holds (/proc/PID/fd, Linux); None where that cannot be done."""
    if holder is None:
        return None
    base = f"/proc/{holder}/fd"
    try:
        names = os.listdir(base)
    except OSError:
        return None
    for name in names:
        try:
            if os.readlink(f"{base}/{name}") != f"pipe:[{key[1]}]":
                continue
            fd = os.open(f"{base}/{name}", os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue
        if identity(fd) == key:
            return fd
        os.close(fd)
    return None
