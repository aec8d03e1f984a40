"""Make a job of N per-rank profiler traces from the recorded 2-rank DDP fixture (rank 0 of a real
A100 NCCL job), for the tests of the rank engines and the benchmark in bench/.

Each copy is the recording with its `distributedInfo` rank and world size rewritten; the slow ranks
are the same recording with every time after its start stretched by `slow_factor` (timestamps and
durations), except the NCCL kernels' durations: a slow rank arrives late at each collective and its
transfer is no longer, as on a real straggler; the other ranks' NCCL kernels last longer by the time
they wait for it there (waiting). `hosts` names the machine each rank ran on in the
trace's metadata (as `prof.add_metadata("hostname", ...)` would; Kineto writes none). `keep`
thins the recording to what the rank rules read (ProfilerSteps, communication kernels, the
DataLoader / DDP forward / optimizer ranges) so that a test's files stay small.
"""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "traces" / "a100_ddp_nccl_2rank.pt.trace.json.gz"
_RANK_RULE_EVENTS = re.compile(r"^ProfilerStep#|nccl|DataLoader.*__next__|^DistributedDataParallel\.forward$|"
                               r"^Optimizer\.step#", re.I)


def load_fixture() -> dict:
    with gzip.open(FIXTURE, "rt") as fh:
        return json.load(fh)


def thin(doc: dict) -> dict:
    """The recording with only the events the rank rules read (and the metadata events, and the
    runtime calls that launched the NCCL kernels: a kernel's step is its launch's)."""
    keep = [e for e in doc["traceEvents"] if e.get("ph") == "M" or _RANK_RULE_EVENTS.search(str(e.get("name", "")))]
    launched = {e.get("args", {}).get("correlation") for e in keep if e.get("cat") == "kernel"}
    kept = {id(e) for e in keep}
    events = [e for e in doc["traceEvents"] if id(e) in kept or (e.get("cat") == "cuda_runtime" and
                                                             e.get("args", {}).get("correlation") in launched)]
    return {**doc, "traceEvents": events}


def stretched(doc: dict, factor: float) -> dict:
    """Every time after the recording's start times `factor`, NCCL kernel durations left as they are."""
    body = [e for e in doc["traceEvents"] if isinstance(e.get("ts"), (int, float)) and e.get("ph") != "M"]
    t0 = min(e["ts"] for e in body)
    out = []
    for e in doc["traceEvents"]:
        e = dict(e)
        if e.get("ph") != "M" and isinstance(e.get("ts"), (int, float)):
            e["ts"] = t0 + (e["ts"] - t0) * factor
            is_comm = e.get("cat") == "kernel" and "nccl" in str(e.get("name", "")).lower()
            if isinstance(e.get("dur"), (int, float)) and not is_comm:
                e["dur"] = e["dur"] * factor
        out.append(e)
    return {**doc, "traceEvents": out}


def waiting(doc: dict, factor: float) -> dict:
    """The recording as a rank that waits for a rank stretched by `factor`: each NCCL kernel lasts
    longer by the lateness the slow rank gained since the previous collective of the step, where
    both last met (the time between them times factor - 1)."""
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in doc["traceEvents"]
             if str(e.get("name", "")).startswith("ProfilerStep#") and e.get("cat") == "user_annotation"]
    last: dict[float, float] = {}  # step start -> the previous collective's start in it
    out = []
    for e in sorted(doc["traceEvents"], key=lambda e: e.get("ts", 0) if e.get("ph") != "M" else -1):
        if e.get("cat") == "kernel" and "nccl" in str(e.get("name", "")).lower():
            start = next((lo for lo, hi in steps if lo <= e["ts"] < hi), None)
            if start is not None:  # the lateness gained since the last collective, where both met
                e = {**e, "dur": e["dur"] + (e["ts"] - last.get(start, start)) * (factor - 1)}
                last[start] = e["ts"]
        out.append(e)
    return {**doc, "traceEvents": out}


def write_job(directory: Path, n: int, slow: tuple[int, ...] = (), slow_factor: float = 1.5,
              hosts: dict[int, str] | None = None, keep: str = "thin", doc: dict | None = None) -> list[Path]:
    """`directory/rank-K.pt.trace.json.gz` for K in range(n); returns their paths in rank order."""
    directory.mkdir(parents=True, exist_ok=True)
    base = doc or load_fixture()
    if keep == "thin":
        base = thin(base)
    slow_doc = stretched(base, slow_factor) if slow else None
    if slow:
        base = waiting(base, slow_factor)
    paths = []
    for rank in range(n):
        d = slow_doc if rank in slow else base
        header = {k: v for k, v in d.items() if k != "traceEvents"}
        header["distributedInfo"] = {**header.get("distributedInfo", {}), "rank": rank, "world_size": n}
        if hosts and rank in hosts:
            header["hostname"] = hosts[rank]
        path = directory / f"rank-{rank}.pt.trace.json.gz"
        with gzip.open(path, "wt", compresslevel=1) as fh:
            fh.write(json.dumps(header)[:-1] + ', "traceEvents": ')
            json.dump(d["traceEvents"], fh)
            fh.write("}")
        paths.append(path)
    return paths
