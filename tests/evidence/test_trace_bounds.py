"""What a trace costs to read is bounded by what it holds, not by how it was made: a gzip that
inflates a hundred times past what a profiler trace compresses to is refused within its first
64 MiB (a 48 MB file inflating to 10 GB of events took 2.6 s and 139 MB resident to refuse; a
9.7 MB one of 2 GB took 160 s and 4.8 GB to read before), and events that all share one `ts` (one
chain of nested events) are attributed in one walk each, not one walk a row (6 MB of them: 201 s
before, 2.8 s)."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from auditor.evidence.errors import InputError
from auditor.evidence.model import Evidence
from auditor.evidence.trace.load import load_trace
from auditor.evidence.trace.model import Trace
from auditor.rules.dataloader_on_device import DataloaderOnDevice

NEXT = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"


def test_a_gzip_that_inflates_past_any_trace_is_refused_early(tmp_path: Path) -> None:
    event = b'{"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": 1, "dur": 1},\n'
    body = event * ((8 << 20) // len(event) + 1)  # ~8 MB a member, ten members: ~80 MB of events
    member = gzip.compress(body, 9)
    path = tmp_path / "bomb.pt.trace.json.gz"
    with open(path, "wb") as f:
        f.write(gzip.compress(b'{"traceEvents": [\n'))
        for _ in range(10):
            f.write(member)
        f.write(gzip.compress(event[:-2] + b"]}"))
    assert len(body) * 10 > 64 << 20 and path.stat().st_size * 100 < len(body) * 10  # (past the floor, past 100x)
    with pytest.raises(InputError, match=r"bomb.pt.trace.json.gz: not a profiler trace: its first [\d,]+ compressed "
                                         r"bytes inflate to [\d,]+, over 100 times as many"):
        load_trace(path, workers=0)


def chained(tmp_path: Path, launches: int, dur: bool = True) -> Path:
    """A step whose loader's `__next__` issues `launches` copies, every event at one `ts`: each
    longer event encloses the next (one chain `launches` deep); with `dur` False, all last 0."""
    d = (lambda x: x) if dur else (lambda x: 0)
    ev = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 1000, "dur": d(10 ** 7)},
          {"ph": "X", "cat": "user_annotation", "name": NEXT, "pid": 1, "tid": 1, "ts": 1000, "dur": d(9 * 10 ** 6)}]
    for i in range(launches):
        ev += [{"ph": "X", "cat": "cpu_op", "name": "aten::to", "pid": 1, "tid": 1, "ts": 1000, "dur": d(10 ** 6 - i)},
               {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "pid": 1, "tid": 1, "ts": 1000,
                "dur": d(10 ** 6 - i - 0.5), "args": {"correlation": i + 1}},
               {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "pid": 0, "tid": 7,
                "ts": 1000, "dur": d(1), "args": {"correlation": i + 1, "bytes": 64, "stream": 7, "device": 0}}]
    path = tmp_path / "chain.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    return path


def check(path: Path):
    ev = Evidence(source="trace")
    ev.__dict__["trace_data"] = [load_trace(path)]
    rule = DataloaderOnDevice()
    return list(rule.check(ev, rule.default_options()))


def test_events_sharing_one_ts_are_attributed_in_one_walk_each(tmp_path: Path, monkeypatch) -> None:
    """Judged by the enclosing events walked (what a loaded machine cannot change), not by time."""
    n = 1500
    walked = [0]
    ancestors = Trace.ancestors

    def counted(self, row):
        out = ancestors(self, row)
        walked[0] += len(out)
        return out

    monkeypatch.setattr(Trace, "ancestors", counted)
    (f,) = check(chained(tmp_path, n))
    assert f.evidence["calls"] == n and f.evidence["copies"] == n and f.evidence["ops"] == {"aten::to": n}
    assert walked[0] <= 4 * n, walked[0]  # (a walk a row: n * n / 2)


def test_ranges_that_all_last_0_hold_nothing(tmp_path: Path) -> None:
    """The loader's ranges merged to none: the rule failed with an IndexError."""
    assert check(chained(tmp_path, 20, dur=False)) == []
