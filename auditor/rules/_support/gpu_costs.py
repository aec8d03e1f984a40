"""GPU costs of rehearsed code (CUDA code run on the CPU), estimated from the device model
(auditor.evidence.devices): what a counted sync, pageable copy or allocator call would cost on the
GPU the user names with `--device`, or on the default row, named in the note. The estimates are
marked `measured: false`, with the figures they used."""
from __future__ import annotations

from auditor.evidence.devices import DEFAULT_DEVICE, DeviceSpec, find_device
from auditor.evidence.model import Evidence
from auditor.findings import Cost, share_of_step, step_basis_ms

# How every estimate here begins its note: what tells a GPU's time estimated in a rehearsal from
# this machine's own (auditor.verify compares a re-run's measure only with the latter)
GPU_ESTIMATE = "estimated for "


def is_gpu_estimate(cost: Cost | None) -> bool:
    """Whether `cost` is one of these: the device model's GPU time, not a time measured here."""
    return cost is not None and cost.ms_per_step is not None and not cost.measured \
        and (cost.note or "").startswith(GPU_ESTIMATE)


def estimate_device(ev: Evidence) -> tuple[DeviceSpec, str]:
    """The row the estimates use, and how the note names it: `--device`'s, else the default's."""
    chosen = find_device(ev.environment.device_model) if ev.environment.device_model else None
    if chosen is not None:
        return chosen, f"an {chosen.name} (--device)"
    default = find_device(DEFAULT_DEVICE)
    assert default is not None
    return default, f"an {default.name} (the default; choose the GPU with --device)"


def estimated(ev: Evidence, ms_per_step: float, note: str) -> Cost:
    ms = round(ms_per_step, 3)
    return Cost(ms_per_step=ms, share_of_step=share_of_step(ms, step_basis_ms(ev)), measured=False, note=note)


def sync_cost(ev: Evidence, per_step: float, what: str = "sync") -> Cost:
    """`per_step` host<->device synchronisations a step: each one round trip on an idle device (the
    row's sync_us, which includes relaunching the queue); the queue each one drains is not known
    in a rehearsal, so this is a lower bound."""
    device, named = estimate_device(ev)
    ms = per_step * device.sync_us / 1e3
    return estimated(ev, ms, f"{GPU_ESTIMATE}{named}: {per_step:g} {what}(s)/step x {device.sync_us:g} us round "
                             "trip each (typical, not vendor-stated); a lower bound: the queued work each one "
                             "waits for is not known in a rehearsal")


def copy_cost(ev: Evidence, bytes_per_step: float) -> Cost:
    """Pageable host->device copies of `bytes_per_step`: their time at the row's pageable bandwidth
    (the host waits for it), with what pinned memory would take beside it in the note."""
    device, named = estimate_device(ev)
    ms = bytes_per_step / (device.pcie_pageable_gbs * 1e9) * 1e3
    pinned = bytes_per_step / (device.pcie_pinned_gbs * 1e9) * 1e3
    return estimated(ev, ms, f"{GPU_ESTIMATE}{named}: {bytes_per_step / 1e6:.2f} MB/step at "
                             f"{device.pcie_pageable_gbs:g} GB/s from pageable memory, blocking the host "
                             f"({pinned:.3f} ms at {device.pcie_pinned_gbs:g} GB/s pinned, overlappable); typical "
                             "achieved bandwidths, not vendor-stated")


def kernel_us(device: DeviceSpec, nbytes: float, flops: float, dtype: str = "") -> float:
    """A kernel's time on `device`, from what it moves and computes: its bytes at the row's memory
    bandwidth or its FLOPs at the row's peak for its dtype (fp32 when not known), whichever is longer."""
    memory = nbytes / (device.mem_bw_gbs * 1e9) * 1e6
    compute = flops / (device.peak_tflops(dtype or "float32") * 1e12) * 1e6 if flops else 0.0
    return max(memory, compute)


def launch_cost(ev: Evidence, per_step: float, what: str, basis: str = "") -> Cost:
    """`per_step` kernel launches a step whose kernels run shorter than their launch: each costs
    the GPU the host's launch time (the row's launch_us), as it waits for the next kernel.
    `basis`: what else the note says of the figures (appended after "; ")."""
    device, named = estimate_device(ev)
    ms = per_step * device.launch_us / 1e3
    return estimated(ev, ms, f"{GPU_ESTIMATE}{named}: {per_step:g} {what}/step x {device.launch_us:g} us launch "
                             "each (typical, not vendor-stated): the host's launch time, which the GPU waits for "
                             "when a kernel runs shorter than its launch" + (f"; {basis}" if basis else ""))
