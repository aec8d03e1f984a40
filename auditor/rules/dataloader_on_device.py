"""dataloader-on-device: the input pipeline launches GPU work while producing a batch.

The trace half finds kernels and copies inside DataLoader iteration on a GPU's profiler trace. The
rehearsal half judges a CUDA rehearsal on the CPU, where there are none to see, from what the
program asked for instead:
* `device-batch`: a batch came out of `DataLoader.__next__` holding tensors meant for the GPU
  (e.g. a TensorDataset over GPU tensors, made under `torch.set_default_device("cuda")`);
* `data-device-op`: a GPU tensor was created while the batch was being made (`.cuda()` or
  `device="cuda"` in `__getitem__` or a collate_fn, or a factory under a default device of cuda);
* the `torch.set_default_device` call itself (a `cuda-standin` tally), which is often the cause.
Counted, never timed: the CPU runs no device work to time.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import numpy as np

from auditor.evidence import model as m
from auditor.evidence.frame import Frame
from auditor.evidence.trace.decode import CAT, GPU_WORK, LAUNCH_SIDE
from auditor.evidence.trace.intervals import merge_intervals
from auditor.evidence.trace.model import Trace
from auditor.evidence.trace.names import DEVICE_ALLOC
from auditor.evidence.trace.queries import DATALOADER_NEXT, frame_location_parts, issuing_op, sites
from auditor.findings import Cost, Edit, Finding, Fix, Location
from auditor.rules._support.places import by_place, steps_run
from auditor.rules._support.text import line_ref, per_step
from auditor.rules._support.step_edits import dataset_copy_out
from auditor.rules.base import Option, Options, Rule, TraceRule

_COLLATE = r"(^|[/(])\S*collate\S*\.py\(|\): \S*collate\S*$"


COUNTED = "counted, not timed: rehearsed on the CPU, where the loader's device work cannot be timed"
DEFAULT_DEVICE = "torch.set_default_device"


def _default_device_calls(ev: m.Evidence) -> list[Frame]:
    """Where the program made CUDA its default device (the usual reason batches are born there)."""
    return [t.where for _, t in ev.tallies(m.CUDA_STANDIN, include_setup=True)
            if t.what == DEFAULT_DEVICE and t.data.get("device") == "cuda" and t.where]


def rehearsal_findings(rule: Rule, evidence: m.Evidence, options: Options) -> list[Finding]:
    """One finding for the run when most steps take batches the loader made on the GPU."""
    if not evidence.steps:
        return []
    n = steps_run(evidence)
    batches = evidence.tallies(m.DEVICE_BATCH)
    ops = by_place(evidence.tallies(m.DATA_DEVICE_OP))
    steps_with = {s for s, _ in batches} | set().union(*(p.steps for p in ops))
    if not steps_with or len(steps_with) < options.min_share_of_steps * n:
        return []
    device_batches = sum(t.count for _, t in batches)
    batch_bytes = sum(t.count * int(t.data.get("bytes") or 0) for _, t in batches)
    # batches returned: a __next__ that ended the epoch (StopIteration) is tallied apart
    drawn = sum(t.count for _, t in evidence.tallies(m.DATA_WAIT) if not t.data.get("exhausted"))
    loader_ids = {t.data.get("loader") for _, t in batches}
    loaders = [d for d in evidence.dataloaders if d.id in loader_ids] or (
        evidence.dataloaders if ops and len(evidence.dataloaders) == 1 else [])
    defaults = _default_device_calls(evidence)
    locs = [Location.of(d.where) for d in loaders if d.where]
    locs += [Location.of(p.where) for p in ops if p.where]
    locs += [Location.of(w) for w in defaults]
    seen: set[tuple[str, int]] = set()
    locs = [loc for loc in locs if (loc.file, loc.line) not in seen and not seen.add((loc.file, loc.line))]
    parts = []
    if device_batches:
        where = ", ".join(f"line {d.where.line}" for d in loaders if d.where) or "the DataLoader"
        parts.append(f"{device_batches} of {drawn or device_batches} batches came out of the DataLoader at "
                     f"{where} already on the GPU ({batch_bytes / n / 1e6:.2f} MB per step)")
    if ops:
        parts.append(f"{per_step(sum(p.count for p in ops) / n)} GPU tensors per step were created while making "
                     "batches: " + "; ".join(f"{p.what} x{per_step(p.count / n)}/step at "
                                              + line_ref(p.where.file if p.where else None,
                                                         p.where.line if p.where else None,
                                                         locs[0].file if locs else None) for p in ops[:4]))
    if defaults:
        parts.append(f"the default device is CUDA (set at line {defaults[0].line}), so the data is "
                     "allocated on the GPU")
    return [rule.finding(
        "Batches are made on the GPU: build them on the CPU instead. "
        "On the GPU the input pipeline runs on the device: " + "; ".join(parts) + ".",
        locations=locs,
        evidence={"steps": n, "steps_with_device_data": len(steps_with), "device_batches": device_batches,
                  "batches": drawn, "batch_bytes_per_step": round(batch_bytes / n),
                  "ops": [{"what": p.what, "file": p.where.file if p.where else None,
                           "line": p.where.line if p.where else None, "count": p.count} for p in ops],
                  "default_device_lines": [w.line for w in defaults],
                  "dataloaders": [{"id": d.id, "line": d.where.line if d.where else None,
                                   "settings": d.settings} for d in loaders],
                  "rehearsal": evidence.environment.rehearsal},
        cost=Cost(ms_per_step=None, share_of_step=None, measured=False, note=COUNTED),
        fix=_fix(ops),
    )]


_ADVICE = ("Build batches on the CPU: no .cuda()/device='cuda' in the Dataset or collate_fn, and keep the default "
           "device on the CPU while the data is made (create the dataset before torch.set_default_device('cuda'), "
           "or pass device='cpu'); set DataLoader(..., pin_memory=True) and move each batch in the step with "
           ".to('cuda', non_blocking=True); then num_workers>0 can prepare batches ahead.")


def _fix(ops: list) -> Fix:
    """The advice, with the patch moving each device copy a Dataset's `__getitem__` returns to
    where its batches are used, pinned (rules._support.step_edits.dataset_copy_out), where every use
    of the dataset and its loaders allows it; the settings the patch does not make stay as config."""
    edits: list[Edit] = []
    moved = []
    for p in ops:
        found = dataset_copy_out(p.where.file, p.where.line) if p.where else None
        if found:
            edits += [e for e in found if e not in edits]
            moved.append(p.where.line)
    if not edits:
        return Fix(summary=_ADVICE, config={"DataLoader.pin_memory": True, "non_blocking": True,
                                            "DataLoader.num_workers": 4})
    uses = sorted({e.start for e in edits} - set(moved))
    summary = (_ADVICE + " fixes.patch moves the copy at line " + ", ".join(map(str, moved))
               + " out of `__getitem__` to where the items are used (lines " + ", ".join(map(str, uses))
               + "), the loaders' batches pinned and copied with non_blocking=True.")
    return Fix(summary=summary, config={"DataLoader.num_workers": 4}, edits=edits)


class DataloaderOnDevice(TraceRule):
    """
    What it detects:
        CUDA launches, copies and allocations issued while the main process is inside DataLoader
        iteration (`enumerate(DataLoader)#..._next__`) or a collate function, from a profiler trace:
        how many per step, the GPU time they caused, the operators and the source lines. What counts:
        runtime/driver calls that put a kernel, copy or memset on the GPU, and device allocations
        (`cudaMalloc*`, `cuMemAlloc*`). What does not: pinning host memory, which `pin_memory=True`
        does inside `__next__` when num_workers=0 (`cudaHostAlloc`, `cudaMallocHost`, `cuMemHostAlloc`,
        `cudaHostRegister`, and the pinned allocator's `cudaEventQuery` polls of earlier copies), and
        other calls whose only GPU-side record is a sync.

    Why it costs:
        GPU work issued from the loader runs on the training stream between steps, so it cannot overlap
        the model; it forbids `num_workers > 0` (CUDA cannot be re-initialised in forked workers), so
        the whole pipeline stays on the training thread; and it usually means small, unbatched copies.

    Example:
        class DS(Dataset):
            def __getitem__(self, i):
                return torch.tensor(self.rows[i], device="cuda")   # a copy per sample

    Fix:
        Produce CPU tensors in the Dataset and collate_fn; move the batch once in the training loop
        with `pin_memory=True` and `.to(device, non_blocking=True)`, then raise `num_workers`.

    Evidence needed:
        A profiler trace with CUDA activity that covers DataLoader iteration (record_function names
        are on by default).
    """

    id = "dataloader-on-device"
    title = "Input pipeline uses the GPU"
    severity = "warning"
    needs = frozenset({"run", "trace"})
    needs_text = "needs a profiler trace with CUDA activity"
    options = (
        Option("min-launches-per-step", 1, "Report when the loader issues at least this many GPU calls per step."),
        Option("min-share-of-steps", 0.5,
               "Rehearsal: report when at least this share of the steps draw a batch that is on the GPU "
               "or create GPU tensors inside DataLoader iteration."),
    )

    def skip_reason(self, evidence: m.Evidence) -> str | None:
        """A run without a trace is judged in CUDA rehearsal only: elsewhere its loader's device work is not recorded."""
        return None if evidence.trace_data or evidence.environment.rehearsal else self.needs_text

    def check(self, evidence: m.Evidence, options: Options) -> Iterable[Finding]:
        yield from super().check(evidence, options)
        yield from rehearsal_findings(self, evidence, options)

    def check_trace(self, trace: Trace, options: Options) -> Finding | None:
        ev = trace.events
        cat, names, ts, end = trace.col("cat"), trace.col("name"), trace.col("ts"), trace.col("end")
        pid, tid = trace.col("pid"), trace.col("tid")
        host = np.isin(cat, (CAT["cpu_op"], CAT["annotation"], CAT["python"])) & ~trace.col("instant")
        pipeline = host & np.isin(names, trace.symbols.matching(DATALOADER_NEXT))
        pipeline |= (cat == CAT["python"]) & np.isin(names, trace.symbols.matching(_COLLATE))
        ranges = np.flatnonzero(pipeline)
        if not len(ranges):
            return None
        # A call counts when the GPU row it maps to is work (kernel, copy, memset), not a sync record:
        # recent profilers pair event polls and waits (the pinned allocator's cudaEventQuery) with
        # a `cuda_sync` row too.
        link = trace.col("link")
        launches_work = np.zeros(len(link), dtype=bool)
        linked = np.flatnonzero(link >= 0)
        launches_work[linked] = np.isin(cat[link[linked]], GPU_WORK)
        launches_work |= np.isin(names, trace.symbols.matching(DEVICE_ALLOC))
        call_mask = np.isin(cat, LAUNCH_SIDE) & launches_work
        calls = np.flatnonzero(call_mask)
        inside = np.zeros(len(calls), dtype=bool)
        for key in set(zip(pid[ranges].tolist(), tid[ranges].tolist())):
            group = ranges[(pid[ranges] == key[0]) & (tid[ranges] == key[1])]
            s, e = merge_intervals(ts[group], end[group])
            if not len(s):  # (its ranges all last 0: nothing runs inside them)
                continue
            on_thread = (pid[calls] == key[0]) & (tid[calls] == key[1])
            t = ts[calls]
            k = np.searchsorted(s, t, side="right") - 1
            inside |= on_thread & (k >= 0) & (t < e[np.maximum(k, 0)])
        found = ev.iloc[calls[inside]]
        steps = trace.step_count()
        if len(found) / steps < options.min_launches_per_step or not len(found):
            return None
        link = found["link"].to_numpy()
        gpu_rows = link[link >= 0]
        cats = ev["cat"].to_numpy()[gpu_rows]
        gpu_ms = float(ev["dur"].to_numpy()[gpu_rows].sum()) / 1000.0
        copy_bytes = int(np.clip(ev["bytes"].to_numpy()[gpu_rows][cats == CAT["memcpy"]], 0, None).sum())
        host_ms = float(found["dur"].sum()) / 1000.0
        rows = found.index.to_numpy()
        ops = Counter(issuing_op(trace, int(r)) or trace.name(int(r)) for r in rows)
        where = sites(trace, rows)
        message = ("The DataLoader runs GPU work: build batches on the host, move them in the loop. "
                   f"The input pipeline issued {len(found)} GPU calls ({len(found) / steps:.1f} per step: "
                   f"{int((cats == CAT['kernel']).sum())} kernels, {int((cats == CAT['memcpy']).sum())} copies) "
                   f"inside DataLoader iteration in {trace.label}, mostly from "
                   f"{', '.join(n for n, _ in ops.most_common(3))}.")
        return self.finding(
            message,
            locations=[Location(*frame_location_parts(f)) for f, _, _ in where],
            evidence={"trace": str(trace.path), "steps": steps, "calls": len(found),
                      "kernels": int((cats == CAT["kernel"]).sum()), "copies": int((cats == CAT["memcpy"]).sum()),
                      "copy_bytes": copy_bytes, "gpu_ms": round(gpu_ms, 3), "host_ms": round(host_ms, 3),
                      "ops": dict(ops.most_common(8)),
                      "sites": [{"file": f.file, "line": f.line, "calls": n} for f, n, _ in where]},
            cost=Cost(ms_per_step=round(host_ms / steps, 3), share_of_step=None,  # (TraceRule.check sets it)
                      measured=True, note="host time of the GPU calls made inside the loader"),
            fix=Fix(summary="Build CPU tensors in the Dataset/collate_fn and move the whole batch in the "
                            "training loop: pin_memory=True, .to(device, non_blocking=True), then num_workers>0.",
                    config={"pin_memory": True, "non_blocking": True, "num_workers": 4}),
        )
