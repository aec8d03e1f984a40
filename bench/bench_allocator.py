"""How fast the caching-allocator simulator replays a snapshot's recorded requests.

    python bench/bench_allocator.py [--repeat N] [SNAPSHOT.pickle ...]

Without paths it measures the shared snapshots with history (tests/fixtures/snapshots). For each:
the replay under the recorded settings (seeding the state at the trace's first entry included),
best of N, in trace entries per second; the whole report (that replay, the recorded figures and every
what-if); and the replay's error against the recording.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from auditor.evidence.allocator.analysis import analyze, capacity_for
from auditor.evidence.allocator.config import from_settings
from auditor.evidence.allocator.replay import replay
from auditor.evidence.snapshot import load_snapshot

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "snapshots"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", type=Path)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    paths = args.paths or sorted(FIXTURES.glob("*.pickle"))
    for p in paths:
        snap = load_snapshot(p)
        for device in sorted(snap.histories):
            entries = len(snap.device_traces[device])
            cfg = snap.allocator_settings.config if snap.allocator_settings else from_settings(None)
            cap = capacity_for(snap, device)[0]
            times = []
            for _ in range(args.repeat):
                t = time.perf_counter()
                replay(snap, device, cfg, cap)
                times.append(time.perf_counter() - t)
            t = time.perf_counter()
            r = analyze(snap, device)
            whole = time.perf_counter() - t
            best = min(times)
            print(f"{p.name} cuda:{device}: {entries:,} entries, replay {best * 1000:.1f} ms "
                  f"({entries / best:,.0f} entries/s, best of {args.repeat}); report with {len(r.what_if)} what-ifs "
                  f"{whole * 1000:.0f} ms; error: peak {r.error.reserved_peak_pct:+.3f}%, reserve after each request "
                  f"max {r.error.reserved_max_diff_bytes} B, segment allocs {r.error.segment_allocs_diff:+d}, "
                  f"frees {r.error.segment_frees_diff:+d}")


if __name__ == "__main__":
    main()
