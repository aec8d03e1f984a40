"""Kernels shorter than their launch, in a profiler trace: what launch-bound reports and gpu-idle
reads to call a step host-bound."""
from __future__ import annotations

import numpy as np

from auditor.evidence.trace.decode import CAT
from auditor.evidence.trace.model import Trace
from auditor.evidence.trace.names import COMM_KERNEL, GRAPH_LAUNCH


def short_kernels(trace: Trace) -> dict | None:
    """Kernels launched one by one (not from a graph, not communication) against their launch calls."""
    ev = trace.events
    kernels = ev[(ev["cat"] == CAT["kernel"]) & (ev["link"] >= 0)]
    if not len(kernels):
        return None
    launch = kernels["link"].to_numpy()
    launch_names = ev["name"].to_numpy()[launch]
    graph = np.isin(launch_names, trace.symbols.matching(GRAPH_LAUNCH))
    # a collective's duration is set by its peers, not by its launch
    comm = np.isin(kernels["name"].to_numpy(), trace.symbols.matching(COMM_KERNEL))
    keep = ~graph & ~comm
    kdur = kernels["dur"].to_numpy()[keep]
    launch = launch[keep]
    if not len(launch):
        return None
    ldur = ev["dur"].to_numpy()[launch]
    short = kdur < ldur
    return {"n_short": int(short.sum()), "share": float(short.sum()) / len(kdur), "kdur": kdur, "ldur": ldur,
            "short": short, "launch": launch, "graph": int(graph.sum()), "comm": int(comm.sum()),
            "under_5us": int((kernels["dur"].to_numpy() < 5.0).sum())}
