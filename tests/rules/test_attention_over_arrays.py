"""The attention chains of the H100 OWLv2 recording (180 hand-written attentions, shapes and stacks
recorded), found over arrays for all chains at once, against the definitions written out chain by
chain and kernel by kernel: a chain's kernels are the GPU rows of the launches its thread started
from its first operator's start until its last one's end, each launch's rows by row; a kernel's part
is the chain's last operator that had started by its launch and had not ended (none: between)."""
from __future__ import annotations

import bisect

import numpy as np
import pytest

from conftest import FIXTURES

from auditor.evidence.trace.attention import attention_chains
from auditor.evidence.trace.decode import GPU_WORK, LAUNCH_SIDE
from auditor.evidence.trace.load import load_trace
from auditor.rules.unfused_attention import _parts

OWLV2 = FIXTURES / "traces" / "h100_owlv2_syncs_dataloader.pt.trace.json.gz"


@pytest.fixture(scope="module")
def trace():
    return load_trace(OWLV2)


def _kernels(trace, chain) -> list[int]:
    cat, link, pid, tid, ts = (trace.col(k) for k in ("cat", "link", "pid", "tid", "ts"))
    first = chain.ops[0]
    launches = [r for r in np.flatnonzero(np.isin(cat, LAUNCH_SIDE) & (link >= 0)).tolist()
                if pid[r] == pid[first] and tid[r] == tid[first] and chain.start <= ts[r] < chain.end]
    gpu = np.flatnonzero(np.isin(cat, GPU_WORK) & (link >= 0)).tolist()
    return [g for r in sorted(launches, key=lambda r: (ts[r], r)) for g in gpu if link[g] == r]


def _part(trace, chain, kernel: int) -> str:
    ts, end, link = trace.col("ts"), trace.col("end"), trace.col("link")
    launched = ts[link[kernel]]
    i = bisect.bisect_right([ts[o] for o in chain.ops], launched) - 1
    op = chain.ops[i] if i >= 0 and launched <= end[chain.ops[i]] else -1
    return {chain.scores: "scores matmul", chain.softmax: "softmax", chain.values: "values matmul"}.get(
        op, "scale, mask, dropout, casts")


def test_each_chain_holds_the_kernels_its_thread_launched_in_its_span(trace) -> None:
    chains = attention_chains(trace)
    assert len(chains) == 180 and sum(len(c.kernels) for c in chains) == 660
    for c in chains:
        assert c.kernels == _kernels(trace, c)
        assert c.ops == sorted(c.ops, key=lambda r: trace.col("ts")[r]) and c.values == c.ops[-1]


def test_each_kernel_time_goes_to_the_operator_that_launched_it(trace) -> None:
    chains = attention_chains(trace)
    dur = trace.col("dur")
    for c, got in zip(chains, _parts(trace, chains)):
        want = dict.fromkeys(got, 0.0)
        for k in c.kernels:
            want[_part(trace, c, k)] += float(dur[k])
        assert got == want
    # every chain's matmuls and softmax launched kernels of their own; 60 chains' scale or mask did too
    parts = _parts(trace, chains)
    assert all(p["scores matmul"] > 0 and p["softmax"] > 0 and p["values matmul"] > 0 for p in parts)
    assert sum(p["scale, mask, dropout, casts"] > 0 for p in parts) == 60
