"""The summary's words for the run's time (auditor.evidence.run_time): its parts per step, the
spread of its steps, and a run with too few timed steps to give steady figures."""
from __future__ import annotations

from auditor.evidence.run_time import ASK_GIVES, RunTime

SHOWN_SLOWEST = 2  # the slowest steps a line names (findings.json has RunTime.slowest's)
# How the parts are named in the summary (PARTS' order)
WORDS = {"work": "work", "data": "data", "between": "between", "syncs": "syncs", "rest": "rest", "audit": "audit"}


def _ms(ms: float) -> str:
    return f"{ms:.2f}" if ms < 10 else f"{ms:.1f}"


def parts_line(rt: RunTime) -> str:
    """'run's time: 37.7 ms/step (30 steps, 2.01 s, 0.88 s of it the audit's): work 19.1, data
    18.6, ...': the run's time per step without the audit's own work, and its parts."""
    parts = [p for p in rt.parts if p.name != "audit" and (p.per_step_ms >= 0.005 or p.name == "work")]
    audit = rt.part("audit")
    own = f", {audit.ms / 1000:.2f} s of it the audit's" if audit.ms >= 5 else ""
    return (f"run's time: {_ms(rt.base_ms)} ms/step ({rt.steps} steps, {rt.span_ms / 1000:.2f} s{own}): "
            + ", ".join(f"{WORDS[p.name]} {_ms(p.per_step_ms)}" + _detail(p.name, rt) for p in parts))


def _detail(name: str, rt: RunTime) -> str:
    """The largest piece of the time between steps, where it is most of it ("(eval 20.1)")."""
    if name != "between":
        return ""
    p = rt.part("between")
    top = max(p.what, key=lambda w: w.ms, default=None)
    return f" ({top.name} {_ms(top.per_step_ms)})" if top is not None and top.ms > 0.5 * p.ms else ""


def spread_line(rt: RunTime) -> str | None:
    """'median step 5.96 ms, p10-p90 5.4-104.1; slowest: 32 107.9 (data 101.7), ...', or None
    without a median."""
    if rt.median_ms is None:
        return None
    spread = spread_text(rt)
    return f"median step {_ms(rt.median_ms)} ms" + (f", {spread}" if spread else "")


def spread_text(rt: RunTime) -> str:
    """The steps' spread beside their median: 'p10-p90 5.4-104.1; slowest: 32 107.9 (data 101.7)'."""
    if rt.median_ms is None:
        return ""
    text = ""
    if rt.p10_ms is not None and rt.p90_ms is not None and rt.steps > 2:
        text = f"p10-p90 {_ms(rt.p10_ms)}-{_ms(rt.p90_ms)}"
    slow = [s for s in rt.slowest if s.ms > rt.median_ms * 1.5][:SHOWN_SLOWEST]
    if slow:
        text += ("; " if text else "") + "slowest: " + ", ".join(
            f"{s.step} {_ms(s.ms)}" + (f" ({', '.join(f'{k} {_ms(v)}' for k, v in waited.items())})"
                                       if (waited := {k: v for k, v in s.waited.items() if v >= 0.5}) else "")
            + (f" {s.role}" if s.role not in ("", "timed") else "") for s in slow)
    return text


def too_few_line(rt: RunTime) -> str | None:
    """A run with fewer timed steps than its figures need: how many, and the --steps to ask for."""
    if not rt.too_few:
        return None
    ask = f": --steps {rt.ask_steps} times {ASK_GIVES}" if rt.ask_steps else ""
    return f"only {rt.timed_steps} timed step(s) (no checks, no profiler): too few for steady figures{ask}"
