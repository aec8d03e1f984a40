"""The summary's word on a run that spent much of its time between its steps (auditor.evidence.between):
the median step and the per-step costs leave that time out, so the summary says how much it was and
what the probes timed in it, where the user's code made it."""
from __future__ import annotations

import os

from auditor.evidence.between import SHOWN_SHARE, Between, between
from auditor.evidence.model import Evidence


def between_phrase(evidence: Evidence) -> str | None:
    """A line for the stretches between the steps where they took SHOWN_SHARE of the span from the
    first step's start to the last one's end, or more; None otherwise."""
    b = between(evidence)
    if b is None or b.share < SHOWN_SHARE:
        return None
    return between_text(b)


def between_text(b: Between) -> str:
    after = ", ".join(map(str, b.after_steps[:6])) + (", ..." if len(b.after_steps) > 6 else "")
    each = f"{b.median_ms:.1f} ms" + (" each (median)" if b.stretches > 1 else "")
    apart = (f", {b.steps_per_stretch:g} steps apart" if b.steps_per_stretch else "")
    text = (f"between steps: {b.share:.0%} of the time from the first step's start to the last one's end ran outside "
            f"the steps, which the step figures leave out: {b.stretches} stretch{'es' if b.stretches > 1 else ''} "
            f"(after step{'s' if b.stretches > 1 else ''} {after}{apart}), {each}")
    if b.work:
        first = b.work[0].file
        parts = []
        for k, w in enumerate(b.work[:3]):
            # (the file named once, at the first; again only where another one's lines are)
            named = f"{os.path.basename(w.file)} " if w.file and (k == 0 or w.file != first) else ""
            where = f"line{'s' if len(w.lines) > 1 else ''} {', '.join(map(str, w.lines))}" if w.lines else "no known line"
            parts.append(f"{w.kind} x{w.count:g} at {named}{where} ({w.ms:.1f} ms)")
        rest = b.median_ms - sum(w.ms for w in b.work)
        text += f"; in each: {'; '.join(parts)}"
        if rest > 0.25 * b.median_ms:
            text += f"; the rest ({rest:.1f} ms) in other work the probes do not time"
    return text
