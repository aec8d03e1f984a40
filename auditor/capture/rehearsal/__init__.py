"""CUDA rehearsal on the CPU: audit code written for a GPU on a machine without one.

`install(mode, source)` is called first thing in the child process, before the probes. It returns
None when no rehearsal happens, else a dict describing it (its "note" goes to the report's
environment section), and announces the rehearsal in one line on stderr.

When it rehearses:
* `--rehearse` ("on"): whenever no CUDA device is present;
* `--no-rehearse` ("off"): never; a `.cuda()` then fails as it would on any CPU box;
* default ("auto"): when no CUDA device is present and the target file asks for one -- it calls
  `.cuda(...)`, names the device `"cuda"` / `"cuda:N"` in a string, uses `torch.cuda.<anything>`
  other than the memory-statistics family (`torch.cuda.is_available()`, `torch.cuda.amp`, ...),
  imports from `torch.cuda`, or calls `set_default_device` with anything but a non-CUDA string.
  Only the target file is read, not the modules it imports. The memory-statistics family alone
  (`reset_peak_memory_stats`, `empty_cache`, `max_memory_allocated`, ...) does not count: such a
  program computes on the CPU, and those calls are answered by auditor.capture.cuda_standins.

What a rehearsal does (four small modules of this package):
* device.py: device requests for CUDA run on the CPU; tensors meant for the GPU are marked and the
  mark follows them through every op; the rules judge marked tensors as GPU tensors;
* cuda.py: `torch.cuda` answers as a one-GPU machine would (stand-ins, recorded);
* data.py: DataLoader batches remember pinning and whether they came out on the GPU;
* dist.py: a job asking for NCCL runs its ranks on gloo, DDP without its device ids.
What the program computes is exactly what its CPU version computes (tests/test_rehearsal.py).
"""
from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch

from auditor.capture import cuda_standins, probes

_CUDA_STRING = re.compile(r"cuda(:\d+)?")
# torch.cuda functions that run on a CPU-only machine anyway (answered by cuda_standins).
MEMORY_FAMILY = frozenset(cuda_standins._answers()) | {"synchronize"}

NOTE = ("CUDA rehearsal: this program asks for CUDA ({reason}) and there is no CUDA device here, so it ran "
        "on the CPU with torch.cuda answering as one idle GPU would (is_available() is True). Tensors it "
        "put on the GPU were tracked and judged as GPU tensors. Timings are CPU timings: costs only a GPU "
        "can show (syncs, host-device "
        "copies, device work in the DataLoader) are counted, not timed. Numbers computed equal those of "
        "the program's CPU version.")


def cuda_reasons(path: str | Path) -> list[tuple[int, str]]:
    """(line, what) for each place in the file that asks for CUDA, in line order (see module doc).
    A method call is placed at the line of its name: a call's own `lineno` is where its receiver
    starts: the first line of an `nn.Sequential(...).cuda()` spread over lines, not the line
    holding `.cuda()`."""
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return []
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _CUDA_STRING.fullmatch(node.value):
            found.append((node.lineno, f'"{node.value}"'))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name, line = node.func.attr, node.func.end_lineno or node.lineno
            if name == "cuda":
                found.append((line, ".cuda()"))
            elif name == "set_default_device" and not _non_cuda_string(node):
                found.append((line, "set_default_device"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "set_default_device":
            if not _non_cuda_string(node):
                found.append((node.lineno, "set_default_device"))
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "cuda"
              and isinstance(node.value.value, ast.Name) and node.value.value.id == "torch"
              and node.attr not in MEMORY_FAMILY):
            found.append((node.end_lineno or node.lineno, f"torch.cuda.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.cuda"):
            if node.module != "torch.cuda" or any(a.name not in MEMORY_FAMILY for a in node.names):
                found.append((node.lineno, f"from {node.module} import ..."))
    return sorted(set(found))


def _non_cuda_string(call: ast.Call) -> bool:
    arg = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "device"), None)
    return isinstance(arg, ast.Constant) and (arg.value is None or (
        isinstance(arg.value, str) and not _CUDA_STRING.fullmatch(arg.value)))


def install(mode: str, source: str | None) -> dict[str, Any] | None:
    """Rehearse if `mode` and the target ask for it (see module doc); None when not rehearsing."""
    if mode == "off" or torch.cuda.is_available():
        return None
    reasons = cuda_reasons(source) if source else []
    if mode == "auto" and not reasons:
        return None
    if reasons:
        line, what = reasons[0]
        reason = f"{what} at line {line} of {Path(source).name}" if source else what
    else:
        reason = "--rehearse"
    from auditor.capture.rehearsal import dist as rehearsal_dist
    from auditor.capture.rehearsal import data as rehearsal_data
    from auditor.capture.rehearsal import cuda as rehearsal_cuda
    from auditor.capture.rehearsal import device as rehearsal_device

    rehearsal_device.install()
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
