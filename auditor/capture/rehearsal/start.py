"""Starting a rehearsal: whether this program is rehearsed, and the installation of the rehearsal's
modules (see the package's doc)."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from auditor.capture import probes, torch_private
from auditor.capture.rehearsal.intent import CLI_PICKS, argument_reason, cli_accelerator, program_reasons

NOTE = ("CUDA rehearsal: this program asks for CUDA ({reason}) and there is no CUDA device here, so it ran "
        "on the CPU with torch.cuda answering as one idle GPU would (is_available() is True). Tensors it "
        "put on the GPU were tracked and judged as GPU tensors. Timings are CPU timings: costs only a GPU "
        "can show (syncs, host-device "
        "copies, device work in the DataLoader) are counted, not timed. Numbers computed equal those of "
        "the program's CPU version.")


def install(mode: str, source: str | None, module: str | None = None,
            argv: list[str] | tuple[str, ...] = ()) -> dict[str, Any] | None:
    """Rehearse if `mode` and the program ask for it (see module doc); None when not rehearsing.
    `source` is the target's file; without one, `module` names the target's module (`-m pkg.mod`,
    `pkg.mod:step`), whose file is found without importing it; `argv`: the program's arguments
    (one that names a CUDA device asks for it too: intent.argument_reason)."""
    if mode == "off" or torch.cuda.is_available():
        return None
    reasons = program_reasons(source, module) if source or module else []
    if cli_accelerator(list(argv)) not in (None, "auto", "gpu", "cuda"):  # LightningCLI told to use the CPU
        reasons = [r for r in reasons if not r[2].endswith(CLI_PICKS)]
    argument = None if reasons else argument_reason(list(argv))
    if mode == "auto" and not reasons and argument is None:
        return None
    if reasons:
        path, line, what = reasons[0]
        reason = f"{what} at line {line} of {Path(path).name}"
    elif argument is not None:
        reason = f"the argument {argument} on its command line"
    else:
        reason = "--rehearse"
    torch_private.check_rehearsal()
    from auditor.capture.rehearsal import dist as rehearsal_dist
    from auditor.capture.rehearsal import data as rehearsal_data
    from auditor.capture.rehearsal import cuda as rehearsal_cuda
    from auditor.capture.rehearsal import device as rehearsal_device
    from auditor.capture.rehearsal import legacy_types as rehearsal_legacy_types
    from auditor.capture.rehearsal import ops as rehearsal_ops
    from auditor.capture.rehearsal import output as rehearsal_output
    from auditor.capture.rehearsal import rnn as rehearsal_rnn
    from auditor.capture.rehearsal import serialization as rehearsal_files

    rehearsal_device.install()
    rehearsal_files.install()
    rehearsal_ops.install()
    rehearsal_rnn.install()
    rehearsal_data.install()
    replaced = rehearsal_cuda.install()
    replaced += rehearsal_legacy_types.install()
    rehearsal_dist.install()
    rehearsal_output.install()
    probes.judge_as_gpu_code(rehearsal_device.device_of)
    # said once for a distributed run: by rank 0 (every rank rehearses, and its evidence notes it)
    if os.environ.get("RANK", "0") in ("0", ""):
        print(f"audit: no CUDA device here: rehearsing this CUDA program on the CPU ({reason}).",
              file=sys.stderr, flush=True)
    return {"mode": mode, "reason": reason, "standins": replaced, "note": NOTE.format(reason=reason)}
