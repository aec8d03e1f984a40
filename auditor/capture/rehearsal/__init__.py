"""CUDA rehearsal on the CPU: audit code written for a GPU on a machine without one.

`install(mode, source, module)` (start.py) is called first thing in the child process, before the probes. It returns
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
from auditor.capture.rehearsal.start import NOTE, install

__all__ = ["NOTE", "install"]
