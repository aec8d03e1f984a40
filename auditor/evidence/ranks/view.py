"""The ranks behind an Evidence, whatever its source (rank_set): the merged view it stores, the
one rank a run holds, or the ranks its parsed traces name."""
from __future__ import annotations

from auditor.evidence import model as m
from auditor.evidence.ranks.combine import combine
from auditor.evidence.ranks.model import RankSet
from auditor.evidence.ranks.runs import info_from_run, rank_of, world_size_of
from auditor.evidence.ranks.traces import ranks_from_traces


def rank_set(ev: m.Evidence) -> RankSet | None:
    """The ranks behind an Evidence: the merged view when present, else the one rank a run holds
    (when it saw anything distributed), else the ranks its traces name. None: nothing distributed."""
    if ev.ranks is not None:
        return ev.ranks
    if ev.source == "run" and ev.distributed is not None:
        rank = rank_of(ev)
        return combine([info_from_run(ev, rank if rank is not None else 0)], world_size_of(ev), "run")
    if ev.trace_data:
        # (several rules ask; each trace's ranks are read once: 2,000 traces were read 4 times)
        key = (id(ev.trace_data), len(ev.trace_data))
        cached = ev.__dict__.get(_CACHE)
        if cached is None or cached[0] != key:
            cached = ev.__dict__[_CACHE] = (key, ranks_from_traces(ev.trace_data))
        return cached[1]
    return None


_CACHE = "_rank_set_of_traces"  # the RankSet of an Evidence's traces, kept on it for the rules that follow
