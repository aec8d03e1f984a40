"""The summary's line of what the audit itself cost, from its measured steps (evidence.own_cost)."""
from __future__ import annotations

from auditor.evidence.model import Evidence
from auditor.evidence.own_cost import own_cost


SAME = 0.05  # steps carrying the audit's work this much faster than those carrying none: noise


def _vs(ms: float, base: float, what: str, of: str) -> str:
    """How `what` (median `ms`) compares with `of` (median `base`), as a person would say it: "+12%
    over the 15 timed steps' 20.10 ms", "2.3x ...", and, when the steps carrying the audit's work
    ran faster than those carrying none, that the machine's load changed (no cost to state)."""
    if ms >= base:
        ratio = f"{ms / base - 1:+.0%} over" if ms < 2 * base else f"{ms / base:.1f}x"
        return f"{ratio} {of} {base:.2f} ms"
    if ms >= (1 - SAME) * base:  # (within the steps' own spread: no cost, and no sign of a change either)
        pct = round((ms / base - 1) * 100)
        return f"{f'{pct:+d}%' if pct else '±0%'} against {of} {base:.2f} ms"
    return (f"{what} ran {1 - ms / base:.0%} faster than {of} {base:.2f} ms: the machine's load changed "
            "during the run, so this cost is not measured")


def _in(steps: list[int], span: list[int] | None) -> list[int]:
    """The steps of `steps` in the loop `span` (first, last step), all of them without one."""
    return [i for i in steps if span[0] <= i <= span[1]] if span else steps


def _loop(span: list[int] | None, loops: int) -> str:
    return f"in steps {span[0]}-{span[1]}, one of the program's {loops} training loops: " if span else ""


def own_cost_phrase(evidence: Evidence) -> str | None:
    """'the audit's own cost, measured: ...', or None for a run with nothing to compare (a
    recording, one step)."""
    c = own_cost(evidence)
    if not evidence.steps or (not c.checked_steps and not c.profiled_steps):
        return None
    parts = []
    checked, timed = _in(c.checked_steps, c.checks_compared_in), _in(c.timed_steps, c.checks_compared_in)
    if c.checked_steps and c.timed_ms and c.checks_compared_in == []:
        parts.append(f"{len(c.checked_steps)} step(s) with numerics checks {c.checked_ms:.2f} ms median (not compared "
                     f"with the {len(c.timed_steps)} timed step(s)' {c.timed_ms:.2f} ms: none of the program's "
                     f"{c.loops} training loops has steps of both)")
    elif c.checked_steps and c.timed_ms:
        parts.append(f"{len(checked)} step(s) with numerics checks {c.checked_ms:.2f} ms median "
                     f"({_loop(c.checks_compared_in, c.loops)}"
                     f"{_vs(c.checked_ms, c.timed_ms, 'the checked steps', f'the {len(timed)} timed step(s)' + chr(39))}"
                     "; the timed steps carry no checks, only the probes)")
        if c.check_spacing:
            parts.append(f"a check cost {c.check_cost_steps:.2f} step(s), so they ran at least {c.check_spacing} "
                         f"steps apart past the first steps, to cost under {c.check_budget:.0%} of the run")
    elif c.checked_steps:
        parts.append(f"every unprofiled step carried numerics checks ({c.checked_ms:.2f} ms median; "
                     "no step without them to compare)")
    if c.profiled_steps and c.unprofiled_ms:
        base = (f"the {len(_in(c.timed_steps, c.profile_compared_in))} timed step(s)'" if c.profile_base == "timed"
                else "the unprofiled steps'")
        parts.append(f"{len(_in(c.profiled_steps, c.profile_compared_in))} profiled step(s) {c.profiled_ms:.2f} ms median "
                     f"({_loop(c.profile_compared_in, c.loops)}"
                     f"{_vs(c.profiled_ms, c.unprofiled_ms, 'the profiled steps', base)}"
                     "; not in the median)")
    return "the audit's own cost, measured: " + "; ".join(parts) if parts else None
