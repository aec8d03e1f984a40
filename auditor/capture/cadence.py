"""How often a periodic part of the audit runs in a long run: at its rate for a number of times,
then at half that rate as often, and so on for a bounded number of halvings (the numerics checks,
the line sampler). A run's first few hundred steps are read as closely as before; past them the
part costs a long run's steady state less and less, down to the last rate, while every stretch of
the run still has its readings (the checks at 1 in 128 read 78 steps of a 10,000-step run)."""
from __future__ import annotations


def due(offset: int, every: int, per_rate: int, halvings: int) -> bool:
    """Whether the step `offset` steps past the part's start is one it runs on: every `every`-th
    for `per_rate` times, then every 2*`every`-th for `per_rate` times, ..., `halvings` times,
    then at the last rate for good (offset 0 always runs)."""
    for _ in range(halvings):
        span = every * per_rate
        if offset < span:
            break
        offset -= span
        every *= 2
    return offset % every == 0
