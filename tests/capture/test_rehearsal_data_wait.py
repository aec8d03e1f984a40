"""Issue #35 item 6: costs measured under rehearsal exclude the rehearsal's own work. A program in
the shape of makemore's bigram run (tests/data/rehearsed_loader.py: a pinned DataLoader over a tiny
dataset whose `__getitem__` makes its tensors with torch calls, `.to(DEVICE)` of each batch) waits
for its batches about as long rehearsed on the CPU as run plainly there with --no-rehearse: the
mode's handling of every torch call the dataset and the collate make, and the stand-in pinning,
are not the program's data wait."""
from __future__ import annotations

import statistics

import pytest

from conftest import ROOT, audit

PROG = ROOT / "tests" / "data" / "rehearsed_loader.py"


def _median_wait_ms(a) -> float:
    ev = a.evidence
    waits = [sum(t["ms"] for t in s["tallies"] if t["kind"] == "data-wait") for s in ev["steps"]]
    assert len(waits) == 24
    return statistics.median(waits)


@pytest.mark.slow
def test_rehearsed_data_wait_is_the_programs_not_the_rehearsals(tmp_path):
    # (the first 6 steps unaudited: what the auditor does once, the first time, is not the question)
    common = ("--no-profile", "--no-numerics", "--quiet", "--skip", "6")
    # A second pair of runs only where the first is out of bounds, the least median of each kept: a
    # burst of load on 2 shared cores lands on one run, not on both pairs (before the fix both
    # pairs read x2.5).
    r = p = float("inf")
    for attempt in range(2):
        rehearsed = audit("run", str(PROG), *common, "--", "cuda", out=tmp_path / f"r{attempt}")
        plain = audit("run", str(PROG), *common, "--no-rehearse", "--", "cpu", out=tmp_path / f"p{attempt}")
        assert rehearsed.returncode == 0 and plain.returncode == 0, rehearsed.stderr[-2000:] + plain.stderr[-2000:]
        assert rehearsed.evidence["environment"]["rehearsal"] and not plain.evidence["environment"]["rehearsal"]
        r, p = min(r, _median_wait_ms(rehearsed)), min(p, _median_wait_ms(plain))
        if r <= 1.7 * p + 0.2:
            break
    # measured under load on 2 shared cores: 1.32 ms rehearsed against 0.52 plainly (x2.5) before
    # the rehearsal's own time was taken out, 0.81-0.93 against 0.59-0.72 after (one run of
    # eight under a load of 4: 1.10 against 0.49)
    assert r <= 1.7 * p + 0.2, (r, p)
