"""Which loop of the program's source holds a line: tells an optimizer that steps in only some
iterations of the training loop (TD3's delayed actor, a WGAN-GP generator stepped every n-th batch)
from one stepped once after an inner loop of another's updates (a WGAN critic's n updates on one
batch), which the step finder cannot tell apart from the optimizer steps alone."""
from __future__ import annotations

import ast
import functools

Line = tuple  # (file, line, ...): a user frame's key


@functools.lru_cache(maxsize=16)
def _loops(file: str) -> tuple[tuple[int, int], ...]:
    """The (first line, last line) of every for and while loop in `file`; () where it cannot be read."""
    try:
        with open(file, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=file)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return ()
    return tuple((n.lineno, n.end_lineno or n.lineno) for n in ast.walk(tree)
                 if isinstance(n, (ast.For, ast.AsyncFor, ast.While)))


def innermost_loop(where: Line | None) -> tuple[str, int, int] | None:
    """(file, first line, last line) of the innermost loop holding `where`'s line; None outside any."""
    if not where:
        return None
    file, line = where[0], where[1]
    spans = [(a, b) for a, b in _loops(file) if a < line <= b]
    if not spans:
        return None
    a, b = max(spans)  # (the innermost begins last)
    return file, a, b


def in_same_loop(repeated: Line | None, other: Line | None) -> bool:
    """Whether `other`'s line is inside the innermost loop that holds `repeated`'s: an optimizer
    stepping again there has begun another iteration of the loop that also steps `other`, which it
    skipped (a step every k-th iteration), not repeated its own inner loop."""
    loop = innermost_loop(repeated)
    return loop is not None and bool(other) and other[0] == loop[0] and loop[1] < other[1] <= loop[2]
