"""A reused --out: an earlier audit's trace of another target was kept in tb/, where TensorBoard
showed it beside this run's. Every earlier trace there is removed; this run's is the one left."""
from __future__ import annotations

from pathlib import Path

from conftest import audit


def test_an_earlier_audits_traces_are_removed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    stale = out / "tb" / "other-step" / "host_1.111.pt.trace.json"
    stale.parent.mkdir(parents=True)
    stale.write_text('{"traceEvents": []}')
    a = audit("run", "examples/clean.py:step", "--steps", "4", "--no-numerics", out=out)
    assert a.returncode == 0, a.stderr
    assert not stale.exists()
    left = sorted(p.relative_to(out).as_posix() for p in (out / "tb").glob("*/*.pt.trace.json*"))
    assert left == sorted(a.evidence["profile"]["trace_files"]) and left
