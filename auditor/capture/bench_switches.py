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

`AUDITOR_BENCH_TOGGLE=BLOCK[:PART,...]` leaves the parts named (default: all of TOGGLED_PARTS) out
in every other block of BLOCK steps (steps BLOCK..2*BLOCK-1, 3*BLOCK..., off), so that one audited
process times its steps with and without them: an A/B free of the drift between two processes.
`AUDITOR_BENCH_TOGGLE=BLOCK:rotate` leaves out one per-step part at a time instead (ROTATED):
of each ROTATED+1 blocks, the first keeps every part, each next one leaves out the next part, so
that one process times each part's cost against the blocks beside it.
`AUDITOR_BENCH_WINDOW_AT=N` starts the profiler window at step N (its warm-up step first), so that
the steps before and after it, in one process, show what the window leaves behind.
"""
from __future__ import annotations

import os

PARTS = ("probes", "hooks", "light", "lines", "scans", "records", "watch", "checks")
OFF = frozenset(p for p in os.environ.get("AUDITOR_BENCH_OFF", "").split(",") if p in PARTS)
TOGGLED_PARTS = ("probes", "hooks", "lines", "scans", "records", "watch", "checks")  # (light: not a cost)
# the parts in every step, each left out in turn by `BLOCK:rotate` (the others run in a few steps:
# their cost is what those steps take over the rest, read from the step records)
ROTATED = ("probes", "hooks", "records", "watch")


def _toggle(spec: str) -> tuple[int, frozenset[str], bool]:
    block, _, names = spec.partition(":")
    if not block.isdigit() or int(block) < 1:
        return 0, frozenset(), False
    if names == "rotate":
        return int(block), frozenset(ROTATED), True
    parts = frozenset(n for n in names.split(",") if n in TOGGLED_PARTS) if names else frozenset(TOGGLED_PARTS)
    return int(block), parts, False


BLOCK, TOGGLED, ROTATE = _toggle(os.environ.get("AUDITOR_BENCH_TOGGLE", ""))
_at = os.environ.get("AUDITOR_BENCH_WINDOW_AT", "")
WINDOW_AT = int(_at) if _at.isdigit() else None


def off(part: str, step: int | None) -> bool:
    """Whether `part` is left out at step `step`: named in AUDITOR_BENCH_OFF, or toggled and in an
    odd block of AUDITOR_BENCH_TOGGLE's (with `rotate`: in its own turn of the blocks)."""
    if part in OFF:
        return True
    if not TOGGLED or part not in TOGGLED or step is None:
        return False
    if ROTATE:
        turn = (step // BLOCK) % (len(ROTATED) + 1)
        return turn > 0 and ROTATED[turn - 1] == part
    return (step // BLOCK) % 2 == 1
