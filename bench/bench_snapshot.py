"""How long loading a CUDA memory snapshot and running the memory rules take, per recorded fixture.

    python bench/bench_snapshot.py [--repeat N] [SNAPSHOT.pickle ...]

Without paths it measures the recorded snapshots in tests/fixtures/snapshots. Reports the best
of N runs (loading includes the safe unpickle, typing every segment/block/trace entry, the derived
figures and the history replay), then the time to materialise the peak moment and to run both rules.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Callable

from auditor.evidence.model import Evidence
from auditor.evidence.snapshot import format_bytes, live_at, load_snapshot
from auditor.rules.allocator_fragmentation import AllocatorFragmentation
from auditor.rules.oom_risk import OomRisk

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "snapshots"


def best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", type=Path)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    paths = args.paths or sorted(FIXTURES.glob("*.pickle"))
    print(f"{'snapshot':42} {'MB':>6} {'segments':>8} {'entries':>8} {'load ms':>8} {'peak ms':>8} {'rules ms':>8}  reserved / free")
    for p in paths:
        snap = load_snapshot(p)
        load_s = best(lambda: load_snapshot(p), args.repeat)
        ev = Evidence(source="snapshot", snapshots=[str(p)])
        ev.__dict__["snapshot_data"] = [snap]
        peak_s = sum(best(lambda d=d, h=h: live_at(snap, d, h.peak_allocated_index), args.repeat)
                     for d, h in snap.histories.items())

        def rules() -> None:
            for rule in (AllocatorFragmentation, OomRisk):
                list(rule().check(ev, rule.default_options()))

        rules_s = best(rules, args.repeat)
        entries = sum(len(t) for t in snap.device_traces)
        print(f"{p.name:42} {p.stat().st_size / 1e6:6.1f} {len(snap.segments):8,} {entries:8,} "
              f"{load_s * 1e3:8.0f} {peak_s * 1e3:8.0f} {rules_s * 1e3:8.0f}  "
              f"{format_bytes(snap.totals.reserved)} / {format_bytes(snap.totals.free)}")


if __name__ == "__main__":
    main()
