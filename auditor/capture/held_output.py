"""Output the audit kept out of the program's own (auditor.capture.rehearsal.output), for the report.

The child holds each line back here as the program runs; the record that ends the run carries the
note (`wire.Ended.notes`, filled by `notes()` when the child builds it), and the parent adds it to
the environment's notes."""
from __future__ import annotations

MAX_KEPT = 5  # lines quoted in the note; the rest counted
MAX_CHARS = 300  # of each quoted line

_HELD: list[str] = []


def hold(line: str) -> None:
    _HELD.append(line)


def notes() -> list[str]:
    """The environment note on what was held back ([] when nothing was)."""
    if not _HELD:
        return []
    quoted = "; ".join(repr(h if len(h) <= MAX_CHARS else h[:MAX_CHARS] + "...") for h in _HELD[:MAX_KEPT])
    more = f" (and {len(_HELD) - MAX_KEPT} more)" if len(_HELD) > MAX_KEPT else ""
    return [f"the CUDA rehearsal kept {len(_HELD)} line(s) a library logged only because of it (a plain run here "
            f"does not log them) out of the program's output: {quoted}{more}"]
