"""The summary's word on a CUDA rehearsal that saw no GPU work: the program's source asks for CUDA
(so it was rehearsed), but the run kept every tensor on the CPU, as a program whose device is its
own setting does when that setting picks the CPU (pytorch/examples dcgan without `--accel`)."""
from __future__ import annotations

from auditor.evidence import model as m
from auditor.evidence.model import Evidence

# what a rehearsed run's GPU work leaves: its copies to the GPU, its GPU kernels, its matmuls
GPU_WORK = (m.H2D_COPY, m.DEVICE_LAUNCH, m.DEVICE_MATMUL)


def no_gpu_work_phrase(evidence: Evidence) -> str | None:
    """A line for a rehearsed run with steps that put nothing on the GPU; None otherwise."""
    if not evidence.environment.rehearsal or not evidence.steps:
        return None
    if any(evidence.tallies(kind, include_setup=True) for kind in GPU_WORK):
        return None
    if any(t.data.get("device") == "cuda" for _, t in evidence.tallies(m.SYNC, include_setup=True)):
        return None
    given = _cpu_setting(evidence.program.argv if evidence.program is not None else [])
    if given is not None:
        return ("CUDA rehearsal: this run put no tensor on the GPU: it computed on the CPU, as its "
                f"`{given[0]}` asks, and no GPU cost was counted. Run it with `{given[1]}` in its place to "
                "rehearse the GPU's path")
    return ("CUDA rehearsal: this run put no tensor on the GPU: it computed on the CPU, as the program does "
            "without one, and no GPU cost was counted. If its device is a setting of its own, run it with the "
            "setting that picks the GPU (`audit run PROGRAM -- --device cuda`) to rehearse that path")


def _cpu_setting(argv: list[str]) -> tuple[str, str] | None:
    """(the program's own argument that picks the CPU, the same for CUDA), in the form it was given:
    `--device=cpu` (nanoGPT's configurator takes no other), or `--device cpu`; None where none does."""
    args = argv[1:]
    for i, a in enumerate(args):
        key, eq, value = a.partition("=")
        if not key.startswith("-") or "device" not in key.lower():
            continue
        if eq and value.lower() == "cpu":
            return a, f"{key}=cuda"
        if not eq and i + 1 < len(args) and args[i + 1].lower() == "cpu":
            return f"{a} {args[i + 1]}", f"{a} cuda"
    return None
