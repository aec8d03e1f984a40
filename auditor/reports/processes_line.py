"""The summary's word on processes the program started itself (`multiprocessing.Process(...).start()`,
`torch.multiprocessing.spawn`): the audit measures the process it started, so what those ran (the
trainers of pytorch/examples mnist_hogwild, a DDP program's `mp.spawn` ranks) is not in it."""
from __future__ import annotations

import os

from auditor.evidence import model as m
from auditor.evidence.model import Evidence


def started_processes_phrase(evidence: Evidence) -> str | None:
    """A line naming where the program started processes of its own, with their start method and
    the function each runs; None when it started none."""
    starts = [t for _, t in evidence.tallies(m.PROCESS_START, include_setup=True)]
    starts += [t for o in evidence.outside for t in o.tallies if t.kind == m.PROCESS_START]
    if not starts:
        return None
    places: dict[tuple, int] = {}
    for t in starts:
        w = t.where
        key = (os.path.basename(w.file) if w else "?", w.line if w else 0, t.data.get("method"), t.data.get("target"))
        places[key] = places.get(key, 0) + t.count
    n = sum(places.values())
    where = "; ".join(f"{count} running `{target}` at {file}:{line}, {method}"
                      for (file, line, method, target), count in places.items())
    stepped = bool(evidence.tallies(m.OPTIMIZER, include_setup=True))
    return (f"processes: the program started {n} process{'es' if n != 1 else ''} of its own ({where}): what "
            f"{'they' if n != 1 else 'it'} ran is not in this audit, which measures the process it started"
            + ("" if stepped else ", where no optimizer stepped"))
