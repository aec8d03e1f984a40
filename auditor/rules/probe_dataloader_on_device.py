"""The probe half of dataloader-on-device: batches that come out of a DataLoader already on the GPU,
seen in CUDA rehearsal.

The DataloaderOnDevice rule (owned elsewhere) calls `probe_dataloader_on_device_findings(self,
evidence, options)` and adds `PROBE_OPTIONS` to its options. On a GPU the trace shows kernels and
copies inside DataLoader iteration; in a rehearsal on the CPU there are none to see, so the
rehearsal records what the program asked for instead:
* `device-batch`: a batch came out of `DataLoader.__next__` holding tensors meant for the GPU
  (e.g. a TensorDataset over GPU tensors, made under `torch.set_default_device("cuda")`);
* `data-device-op`: a GPU tensor was created while the batch was being made (`.cuda()` or
  `device="cuda"` in `__getitem__` or a collate_fn, or a factory under a default device of cuda);
* the `torch.set_default_device` call itself (a `cuda-standin` tally), which is often the cause.
Counted, never timed: the CPU runs no device work to time.
"""
from __future__ import annotations

from typing import Any

from auditor.evidence import model as m
from auditor.rules.base import Option
from auditor.findings import Cost, Finding, Fix, Location
from auditor.rules._support.places import by_place, steps_run
from auditor.rules._support.text import line_ref, per_step

PROBE_OPTIONS: tuple[Option, ...] = (
    Option("min-share-of-steps", 0.5,
           "Rehearsal: report when at least this share of the steps draw a batch that is on the GPU "
           "or create GPU tensors inside DataLoader iteration."),
)
COUNTED = "counted, not timed: rehearsed on the CPU, where the loader's device work cannot be timed"
DEFAULT_DEVICE = "torch.set_default_device"


def _default_device_calls(ev: m.Evidence) -> list[m.Frame]:
    """Where the program made CUDA its default device (the usual reason batches are born there)."""
    return [t.where for _, t in ev.tallies(m.CUDA_STANDIN, include_setup=True)
            if t.what == DEFAULT_DEVICE and t.data.get("device") == "cuda" and t.where]


def probe_dataloader_on_device_findings(rule: Any, evidence: m.Evidence, options: dict[str, Any]) -> list[Finding]:
    """One finding for the run when most steps take batches the loader made on the GPU."""
    if not evidence.steps:
        return []
    n = steps_run(evidence)
    batches = evidence.tallies(m.DEVICE_BATCH)
    ops = by_place(evidence.tallies(m.DATA_DEVICE_OP))
    steps_with = {s for s, _ in batches} | set().union(*(p.steps for p in ops))
    if not steps_with or len(steps_with) < options.get("min-share-of-steps", 0.5) * n:
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
        fix=Fix(summary="Build batches on the CPU: no .cuda()/device='cuda' in the Dataset or collate_fn, and "
                        "keep the default device on the CPU while the data is made (create the dataset before "
                        "torch.set_default_device('cuda'), or pass device='cpu'); set DataLoader(..., "
                        "pin_memory=True) and move each batch in the step with .to('cuda', non_blocking=True); "
                        "then num_workers>0 can prepare batches ahead.",
                config={"DataLoader.pin_memory": True, "non_blocking": True, "DataLoader.num_workers": 4}),
    )]
