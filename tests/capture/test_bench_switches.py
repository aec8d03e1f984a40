"""The bench's internal switches (auditor/capture/bench_switches.py): which parts a toggled audit
leaves out at which step, as bench/bench_steady_parts.py --toggle reads its blocks."""
from __future__ import annotations

from auditor.capture import bench_switches as bs


def test_a_toggle_names_its_block_and_parts():
    assert bs._toggle("50") == (50, frozenset(bs.TOGGLED_PARTS), False)
    assert bs._toggle("10:probes,lines,light,bogus") == (10, frozenset({"probes", "lines"}), False)
    assert bs._toggle("25:rotate") == (25, frozenset(bs.ROTATED), True)
    assert bs._toggle("") == (0, frozenset(), False)
    assert bs._toggle("0") == (0, frozenset(), False)
    assert bs._toggle("x:probes") == (0, frozenset(), False)


def test_parts_are_off_in_odd_blocks_only(monkeypatch):
    monkeypatch.setattr(bs, "BLOCK", 4)
    monkeypatch.setattr(bs, "TOGGLED", frozenset({"checks"}))
    monkeypatch.setattr(bs, "OFF", frozenset({"scans"}))
    assert [bs.off("checks", i) for i in range(12)] == [False] * 4 + [True] * 4 + [False] * 4
    assert not any(bs.off("lines", i) for i in range(12))  # (not toggled)
    assert all(bs.off("scans", i) for i in range(12))  # (AUDITOR_BENCH_OFF: at every step)
    assert not bs.off("checks", None)


def test_rotate_leaves_out_one_part_a_block_after_a_block_with_all(monkeypatch):
    monkeypatch.setattr(bs, "BLOCK", 2)
    monkeypatch.setattr(bs, "TOGGLED", frozenset(bs.ROTATED))
    monkeypatch.setattr(bs, "ROTATE", True)
    cycle = 2 * (len(bs.ROTATED) + 1)
    for step in range(2 * cycle):
        out = [p for p in bs.TOGGLED_PARTS if bs.off(p, step)]
        turn = (step // 2) % (len(bs.ROTATED) + 1)
        assert out == ([] if turn == 0 else [bs.ROTATED[turn - 1]]), step
    assert [p for p in bs.ROTATED if any(bs.off(p, s) for s in range(cycle))] == list(bs.ROTATED)
