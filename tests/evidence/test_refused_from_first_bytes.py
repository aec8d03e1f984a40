"""A large file that is not a recording is refused from its first bytes, not read whole first: a
2 GB zero-filled .pickle took 7 s and 2.1 GB of memory to refuse, a `{"traceEvents":[` + zeros
trace 12 s. The files here are sparse (1 GiB each, no disk taken); each is refused at once."""
from __future__ import annotations

import resource
import time
from pathlib import Path

import pytest

from auditor.evidence.errors import InputError
from auditor.evidence.snapshot import load_snapshot
from auditor.evidence.trace.load import load_trace

GiB = 1 << 30


def sparse(path: Path, head: bytes) -> Path:
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(GiB)
    return path


@pytest.mark.parametrize("name, head, load, message", [
    ("zeros.pickle", b"", load_snapshot, "not a pickle"),
    ("proto.pickle", b"\x80\x04", load_snapshot, "not a CUDA memory snapshot (the pickle holds no dict or list)"),
    ("frame.pickle", b"\x80\x04\x95" + (2 * GiB).to_bytes(8, "little") + b"}", load_snapshot,
     "a frame longer than the file"),
    ("open.json", b'{"traceEvents":[', load_trace, "traceEvents holds a non-object"),
    ("event.json", b'{"traceEvents":[{"ph": "X", "name": "', load_trace, "no event ends within 64 MiB"),
])
def test_large_files_that_are_no_recording_are_refused_at_once(tmp_path: Path, name: str, head: bytes, load,
                                                               message: str) -> None:
    path = sparse(tmp_path / name, head)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    t = time.perf_counter()
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load(path)
    assert time.perf_counter() - t < 5.0  # (reading 1 GiB of zeros took several seconds)
    # (this process's peak memory did not grow by the file: it was not read whole)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 512 * 1024
