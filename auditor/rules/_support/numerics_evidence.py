"""How the numerics rules (nonfinite, grad-explosion, lr-schedule, amp-unscaled, zero-gradients) read
the numerics collector's evidence: its values, the user's lines of its sites, and whether a run
has any (auditor.evidence.numerics_view.NumericsView)."""
from __future__ import annotations

import math
from typing import Any

from auditor.evidence import model as m
from auditor.evidence.frame import recorded_frame
from auditor.evidence.numerics import Where, val
from auditor.evidence.numerics_view import NumericsView
from auditor.findings import Location


def finite(x: Any) -> bool:
    v = val(x)
    return v is not None and math.isfinite(v)


def location(where: Where | dict | None) -> Location | None:
    """The Location of a user's line: a site's `Where`, or an event's "where" dict."""
    frame = recorded_frame(where)
    return Location(file=frame.file, line=frame.line, code=frame.code) if frame is not None else None


def site_location(view: NumericsView, site: int | None) -> Location | None:
    return location(view.site(site).where) if site is not None else None


def short(x: Any) -> str:
    v = val(x)
    if v is None:
        return "?"
    if not math.isfinite(v):
        return str(x)
    return f"{v:.3g}"


NEEDS_NUMERICS = "needs a run (`audit run`) with the numerics collector"  # (the rules' needs_text)


def needs_numerics(ev: m.Evidence) -> str | None:
    """Why a run has no numerics evidence to judge (None: it has)."""
    if not any(s.numerics is not None for s in ev.steps):
        return "the run has no numerics evidence (`--no-numerics`, or no step ran)"
    return None
