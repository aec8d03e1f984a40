"""Whether an exception that ended a rehearsed run is the rehearsal's, not the program's.

The rehearsal tells the program it has a GPU. Two kinds of failure then come from the audit, and
a plain run on this machine would not meet them:
* torch's "no CUDA here" errors (`Torch not compiled with CUDA enabled`, a CPU build's missing
  `torch._C._cuda_*`, ...) after the program, or a library it calls, was told a GPU is there
  (`torch.cuda.is_available()` answered True): a CUDA call the rehearsal does not stand in for,
  on a path a plain run, told there is no GPU, does not take;
* an attribute a rehearsal stand-in lacks (a `torch.cuda.Stream` method it does not have).
The GPU's own refusals the rehearsal reproduces on purpose (a GPU tensor meeting a host tensor,
`.numpy()` of a GPU tensor) stay the program's: a GPU run of it fails there too.
`audit_cause(exc)` says which, in one sentence naming `--no-rehearse`; None when it is the program's.
"""
from __future__ import annotations

from pathlib import Path

from auditor.capture import probes
from auditor.capture.rehearsal import cuda

# torch's errors for a CUDA it does not have (a CPU-only build, no driver, no device)
NO_CUDA = ("Torch not compiled with CUDA enabled", "Found no NVIDIA driver on your system", "No CUDA GPUs are available",
           "Cannot access accelerator device when none is available", "has no attribute '_cuda_",
           "CUDA driver initialization failed", "not compiled with CUDA")


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return ""


NO_REHEARSE = "`audit run --no-rehearse` runs it as a plain run does"


def audit_cause(exc: BaseException) -> str | None:
    """One sentence when the rehearsal, not the program, caused `exc` (see module doc), else None."""
    if not probes.judged_as_gpu_code() or isinstance(exc, (KeyboardInterrupt, SystemExit)):
        return None
    obj = getattr(exc, "obj", None) if isinstance(exc, AttributeError) else None
    if obj is not None and type(obj).__module__.startswith("auditor."):
        return f"the audit's CUDA rehearsal caused this, not the program: its stand-in {type(obj).__name__} lacks it; {NO_REHEARSE}"
    if cuda.TOLD_GPU and any(s in _text(exc) for s in NO_CUDA):
        what, file, line = cuda.TOLD_GPU[0]
        at = f" at {Path(file).name}:{line}" if file else ""
        return (f"the audit's CUDA rehearsal caused this, not the program: it answered {what}(){at} as a GPU "
                f"would, and torch has no CUDA here for what the program did next; {NO_REHEARSE}, on its CPU path")
    return None
