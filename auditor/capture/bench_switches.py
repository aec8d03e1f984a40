"""Internal switches for bench/bench_steady_parts.py, not a user option: `AUDITOR_BENCH_OFF` names,
comma-separated, parts of the audit's per-step machinery to leave out, so that the bench can
measure each part's share of the steady-state cost. A run with any of them off finds less than an
audit does; nothing else reads them.

* probes: the probes' wrappers on torch calls (syncs, timed calls, anomaly mode, hook
  registration); the backward, phase and data probes stay (the steps are found with them)
* hooks: the numerics collector's global module hooks in the steps it does not check (taken
  out of torch's dicts there, so the forward phase goes untimed)
* light: the outermost module calls outside checked steps keep the module hooks on for the calls
  inside them (torch's slow path for every module call, as before Numerics._light_call)
* lines: the line sampler (as AUDITOR_LINE_SAMPLING=0)
* scans: the graph scans at step boundaries
* records: the step's record (times, tallies, collected data) is not sent
* watch: the loss watch of unchecked steps
* checks: the numerics checks after the dense start (one step in 32, fewer in a long run)
"""
from __future__ import annotations

import os

PARTS = ("probes", "hooks", "light", "lines", "scans", "records", "watch", "checks")
OFF = frozenset(p for p in os.environ.get("AUDITOR_BENCH_OFF", "").split(",") if p in PARTS)
