"""The evidence stream from the child process to the parent: one JSON object per line on a pipe.

The child writes each record as soon as it exists (environment, each step, the ending), so if the
child dies hard the parent still holds every record written before.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Iterator

import msgspec

_encoder = msgspec.json.Encoder()


class Writer:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pid = os.getpid()
        self.lock = threading.Lock()

    def send(self, kind: str, **payload: Any) -> None:
        if os.getpid() != self.pid:  # a forked DataLoader worker inherited the pipe: stay silent
            return
        data = _encoder.encode({"kind": kind, **payload}) + b"\n"
        with self.lock:
            view = memoryview(data)
            while view:
                n = os.write(self.fd, view)
                view = view[n:]


def read_records(stream) -> Iterator[tuple[dict[str, Any], bytes]]:
    """(record, raw line) for each complete line; a torn last line (the child died mid-write) is dropped."""
    for line in stream:
        if not line.endswith(b"\n"):
            return
        try:
            yield msgspec.json.decode(line), line
        except msgspec.DecodeError:
            continue
