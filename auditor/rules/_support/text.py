"""How messages write numbers, sizes and source lines."""
from __future__ import annotations

import numpy as np


def per_step(x: float) -> str:
    """A count per step for a message, to 3 significant digits and never in exponent form: 8.23,
    0.233, 4, 120. Counts over a few dozen steps support no more (`:g` would print 8.23333)."""
    if abs(x) >= 100:
        return f"{x:.0f}"
    return np.format_float_positional(x, precision=3, fractional=False, trim="-")


def size_text(nbytes: float) -> str:
    """A byte count for a message, in MB (1e6 bytes) from 0.01 MB up and in KB or bytes below, so
    that a 512-byte copy does not read "0.00 MB" beside the megabytes it is listed with."""
    if nbytes >= 10_000:
        return f"{nbytes / 1e6:.2f} MB"
    if nbytes >= 1000:
        return f"{nbytes / 1e3:.1f} KB"
    return f"{nbytes:.0f} bytes"


def file_name(path: str) -> str:
    """The last part of a path, with either separator: what a message calls a file by."""
    return path.replace("\\", "/").rsplit("/", 1)[-1]


def line_ref(file: str | None, line: int | None, headline_file: str | None) -> str:
    """`line 14` for a site in the file the finding's headline names, `agent.py:39` for one in
    another file: a message listing sites across a package must say which file each is in."""
    if line is None:
        return "line ?"
    if file and headline_file and file != headline_file:
        return f"{file_name(file)}:{line}"
    return f"line {line}"


def sites_text(where: list, steps: int, sizes: bool = False) -> str:
    """"; at line 14 (2/step); agent.py:39 (1/step)" for the user sites `where` a trace rule found
    ([(frame, count, weight)], auditor.evidence.trace.queries.sites), each with its count per step
    and, with `sizes`, its weight per step as bytes; "" when there is none."""
    if not where:
        return ""
    first = where[0][0].file
    return "; at " + "; ".join(
        f"{line_ref(f.file, f.line, first)} ({per_step(n / steps)}/step"
        + (f", {size_text(w / steps)})" if sizes else ")") for f, n, w in where)
