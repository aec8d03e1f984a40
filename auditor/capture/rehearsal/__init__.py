"""CUDA rehearsal on the CPU: audit code written for a GPU on a machine without one.

`install(mode, source, module)` is called first thing in the child process, before the probes. It returns
None when no rehearsal happens, else a dict describing it (its "note" goes to the report's
environment section), and announces the rehearsal in one line on stderr.

When it rehearses:
* `--rehearse` ("on"): whenever no CUDA device is present;
* `--no-rehearse` ("off"): never; a `.cuda()` then fails as it would on any CPU box;
* default ("auto"): when no CUDA device is present and the program's own code asks for one: the
  target file or one of the user's modules it imports (not a library's) calls `.cuda(...)`, names
  the device `"cuda"` in a string, uses `torch.cuda` or `torch.accelerator` beyond their
  memory-statistics family, ... (intent.py reads them, before anything runs). The note names the
  first place found ('".cuda()" at line 12 of trainer.py').

What a rehearsal does (five small modules of this package, beside intent.py):
* device.py: device requests for CUDA run on the CPU; tensors meant for the GPU are marked and the
  mark follows them through every op; the rules judge marked tensors as GPU tensors;
* cuda.py: `torch.cuda` and `torch.accelerator` answer as a one-GPU CUDA machine would
  (stand-ins, recorded): `torch.accelerator.current_accelerator()` is `device("cuda")`;
* data.py: DataLoader batches remember pinning and whether they came out on the GPU;
* dist.py: a job asking for NCCL runs its ranks on gloo, DDP without its device ids;
* serialization.py: `torch.save`/`torch.load` of GPU tensors behave as on a GPU (files stay the CPU run's).
What the program computes is exactly what its CPU version computes (tests/test_rehearsal.py).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from auditor.capture import probes
from auditor.capture.rehearsal.intent import program_reasons

NOTE = ("CUDA rehearsal: this program asks for CUDA ({reason}) and there is no CUDA device here, so it ran "
        "on the CPU with torch.cuda answering as one idle GPU would (is_available() is True). Tensors it "
        "put on the GPU were tracked and judged as GPU tensors. Timings are CPU timings: costs only a GPU "
        "can show (syncs, host-device "
        "copies, device work in the DataLoader) are counted, not timed. Numbers computed equal those of "
        "the program's CPU version.")


def install(mode: str, source: str | None, module: str | None = None) -> dict[str, Any] | None:
    """Rehearse if `mode` and the program ask for it (see module doc); None when not rehearsing.
    `source` is the target's file; without one, `module` names the target's module (`-m pkg.mod`,
    `pkg.mod:step`), whose file is found without importing it."""
    if mode == "off" or torch.cuda.is_available():
        return None
    reasons = program_reasons(source, module) if source or module else []
    if mode == "auto" and not reasons:
        return None
    if reasons:
        path, line, what = reasons[0]
        reason = f"{what} at line {line} of {Path(path).name}"
    else:
        reason = "--rehearse"
    from auditor.capture.rehearsal import dist as rehearsal_dist
    from auditor.capture.rehearsal import data as rehearsal_data
    from auditor.capture.rehearsal import cuda as rehearsal_cuda
    from auditor.capture.rehearsal import device as rehearsal_device
    from auditor.capture.rehearsal import ops as rehearsal_ops
    from auditor.capture.rehearsal import serialization as rehearsal_files

    rehearsal_device.install()
    rehearsal_files.install()
    rehearsal_ops.install()
    rehearsal_data.install()
    replaced = rehearsal_cuda.install()
    rehearsal_dist.install()
    probes.DEVICE_OF = rehearsal_device.device_of
    probes.JUDGE_AS_CUDA = True
    # said once for a distributed run: by rank 0 (every rank rehearses, and its evidence notes it)
    if os.environ.get("RANK", "0") in ("0", ""):
        print(f"audit: no CUDA device here: rehearsing this CUDA program on the CPU ({reason}); "
              "GPU-only costs are counted, timings are CPU timings.", file=sys.stderr, flush=True)
    return {"mode": mode, "reason": reason, "standins": replaced, "note": NOTE.format(reason=reason)}
