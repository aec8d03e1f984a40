"""Make the recordings tests/data/run_time/README.md describes from the real GPU recordings the
project carries (tests/fixtures). Nothing is computed anew: events are kept as recorded, moved in
time, renumbered where ids must stay apart, and their ProfilerStep ranges taken out or redrawn.

    python tests/data/run_time/derive_traces.py
"""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parents[1] / "fixtures"
STEP = re.compile(r"^ProfilerStep#(\d+)$")
GPU = ("Kernel", "Memset", "Memcpy", "kernel", "gpu_memset", "gpu_memcpy")
IDS = ("correlation", "External id", "external id", "Ev Idx", "Python id", "Python parent id", "Record function id")


def load(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def write(doc: dict, path: Path) -> None:
    with gzip.open(path, "wt", compresslevel=9) as f:
        json.dump(doc, f, separators=(",", ":"))
    print(f"{path.name}: {len(doc['traceEvents'])} events, {path.stat().st_size / 1e6:.2f} MB")


def step_groups(events: list[dict]) -> list[tuple[dict, list[dict]]]:
    """Each CPU-side ProfilerStep with the events of its time on the host and the GPU work its
    launches made (by correlation), the step's range itself, flows and memory instants left out."""
    steps = sorted((e for e in events if STEP.match(str(e.get("name", ""))) and e.get("cat") in ("Operator", "cpu_op", "user_annotation")),
                   key=lambda e: e["ts"])
    out = []
    for s in steps:
        lo, hi = s["ts"], s["ts"] + s["dur"]
        host = [e for e in events if e.get("ph") == "X" and e.get("cat") not in GPU and e is not s
                and isinstance(e.get("ts"), (int, float)) and lo <= e["ts"] < hi and e.get("cat") != "Trace"]
        launched = {e["args"]["correlation"] for e in host if "correlation" in e.get("args", {})}
        gpu = [e for e in events if e.get("cat") in GPU and e.get("args", {}).get("correlation") in launched]
        out.append((s, host + gpu))
    return out


def stalled_resnet() -> None:
    """ResNet-50 on a V100 whose DataLoader stalls in one step in four, recorded without a profiler
    schedule: the steps of the four-worker recording, with every fourth one taken from the recording
    that loads in the training process (num_workers=0, ~70 ms of loading a step), laid end to end;
    no ProfilerStep ranges, so the steps are found from the loop's fetches and optimizer steps."""
    fast = load(FIXTURES / "traces" / "v100_resnet50_dataloader_workers4.pt.trace.json.gz")
    slow = load(FIXTURES / "traces" / "v100_resnet50_dataloader_workers0.pt.trace.json.gz")
    f_groups, s_groups = step_groups(fast["traceEvents"]), step_groups(slow["traceEvents"])
    order = [f_groups[1], f_groups[2], f_groups[3], s_groups[0], f_groups[4], f_groups[1], f_groups[2], s_groups[1],
             f_groups[3], f_groups[4], f_groups[1], s_groups[2], f_groups[2], f_groups[3]]
    cursor = f_groups[1][0]["ts"]
    pid, tid = f_groups[1][1][0]["pid"], f_groups[1][1][0]["tid"]
    meta = [e for e in fast["traceEvents"] if e.get("ph") == "M"]
    events = []
    for k, (step, group) in enumerate(order):
        shift = cursor - step["ts"]
        for e in group:
            e2 = dict(e, ts=e["ts"] + shift)
            if e2.get("cat") not in GPU:  # (both recordings' training thread as one)
                e2["pid"], e2["tid"] = pid, tid
            args = dict(e2.get("args", {}))
            for key in IDS:
                if isinstance(args.get(key), int):
                    args[key] = args[key] + (k + 1) * 10_000_000
            e2["args"] = args
            events.append(e2)
        cursor += step["dur"]
    events.sort(key=lambda e: e["ts"])
    doc = {k: v for k, v in fast.items() if k != "traceEvents"}
    doc["traceEvents"] = meta + events
    write(doc, HERE / "v100_resnet50_stalls_no_schedule.pt.trace.json.gz")


def one_synced_step() -> None:
    """The H200 recording of examples/gpu_bound.py with its three ProfilerSteps and the
    `torch.cuda.synchronize()` after them redrawn as one step: the host issues three iterations in
    12 ms and waits 238 ms in cudaDeviceSynchronize while the device runs them (as an inference
    step that ends in a sync does). The GPU-side ProfilerStep range stays as recorded (it begins
    58 ms into the step, where the device reached the first step's work)."""
    doc = load(FIXTURES / "h200" / "plain_gpu_bound.json.gz")
    events = doc["traceEvents"]
    cpu_steps = [e for e in events if STEP.match(str(e.get("name", ""))) and e.get("cat") == "user_annotation"]
    sync = next(e for e in events if e.get("name") == "cudaDeviceSynchronize")
    first = min(cpu_steps, key=lambda e: e["ts"])
    one = dict(first, dur=sync["ts"] + sync["dur"] - first["ts"])
    keep = [e for e in events if not (STEP.match(str(e.get("name", ""))) and e.get("cat") == "user_annotation")]
    doc["traceEvents"] = keep + [one]
    write(doc, HERE / "h200_gpu_bound_one_synced_step.json.gz")


if __name__ == "__main__":
    stalled_resnet()
    one_synced_step()
