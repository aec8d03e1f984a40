"""Internal switches for bench/bench_steady_parts.py, not a user option. A run with any of them set
finds less than an audit does; nothing else reads them.

`AUDITOR_BENCH_OFF` names, comma-separated, parts of the per-step machinery to leave out (PARTS):
probes (the wrappers on torch calls; backward, phase and data probes stay), hooks (the numerics
module hooks in unchecked steps), light (outermost module calls keep the hooks on inside), lines
(the line sampler), scans (graph scans), records (the step's record is not sent), watch (the loss
watch of unchecked steps), checks (the numerics checks after the dense start).
`AUDITOR_BENCH_TOGGLE=BLOCK[:PART,...]` leaves the parts named (default: TOGGLED_PARTS) out in
every other block of BLOCK steps, so one process times its steps with and without them;
`BLOCK:rotate` leaves out one part of ROTATED at a time, block by block.
`AUDITOR_BENCH_WINDOW_AT=N` starts the profiler window at step N.
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
