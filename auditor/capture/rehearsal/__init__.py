"""CUDA rehearsal on the CPU: audit code written for a GPU on a machine without one.

`install(mode, source, module)` (start.py) runs first in the child process, before the probes,
returns None when no rehearsal happens (else a dict whose "note" goes to the report's environment
section) and announces the rehearsal in one line on stderr. It rehearses with `--rehearse`
whenever no CUDA device is present, never with `--no-rehearse`, and by default when no CUDA device
is present and the program's own code asks for one (intent.py reads that before anything runs;
the note names the first place found).

The modules: device.py (CUDA device requests run on the CPU; tensors meant for the GPU are marked
and the rules judge them as GPU tensors), cuda.py (`torch.cuda` and `torch.accelerator` answer as a
one-GPU machine), data.py (batches remember pinning and their device), dist.py (NCCL jobs run on
gloo), serialization.py (saving and loading GPU tensors), ops.py and launches.py (what the GPU
would run). What the program computes is exactly what its CPU version computes
(tests/test_rehearsal.py).
"""
from auditor.capture.rehearsal.start import NOTE, install

__all__ = ["NOTE", "install"]
