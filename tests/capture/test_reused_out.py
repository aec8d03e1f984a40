"""A reused --out: an earlier audit's trace of another target was kept in tb/, where TensorBoard
showed it beside this run's. Every earlier trace there is removed; this run's is the one left."""
from __future__ import annotations

from quoted_out_run import STALE, quoted_out_run


def test_an_earlier_audits_traces_are_removed(tmp_path_factory) -> None:
    a = quoted_out_run(tmp_path_factory)  # (an --out with a quote and a backslash: test_trace_path)
    out = a.out
    assert a.returncode == 0, a.stderr
    assert not (out / STALE).exists()  # (written there before the run)
    left = sorted(p.relative_to(out).as_posix() for p in (out / "tb").glob("*/*.pt.trace.json*"))
    assert left == sorted(a.evidence["profile"]["trace_files"]) and left
