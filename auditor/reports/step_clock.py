"""The summary's line on the step's clock: which bound the reported step is on, and the other clock."""
from __future__ import annotations

import statistics

from auditor.evidence.model import Evidence
from auditor.evidence.step_clock import rehearsed_device_ms, rehearsed_host_steps, step_clock


def clock_phrase(evidence: Evidence) -> str | None:
    """'step clock: device-bound: ...', or None where only the host's clock is known."""
    c = step_clock(evidence)
    note = f" ({c.note})" if c.note else ""
    if c.source == "estimate" and c.device_ms is not None and c.host_ms is not None:
        name = _gpu_name(evidence)
        kernels = f"about {c.device_ms:.2f} ms" if c.device_ms >= 0.01 else "under 0.01 ms"
        model = f"the device model puts its kernels at {kernels} a step (the rehearsed calls, tripled where autograd records a backward)"
        floor = c.issue_floor_ms or 0.0
        least = (f"the host would take at least {floor:.2f} ms a step to issue it (its waits for data and a "
                 "launch time per kernel)")
        if c.data_supply_ms is not None:
            least = (f"the host would take at least {floor:.2f} ms a step, waiting for its batches: its DataLoader's "
                     f"workers take {c.data_supply_ms:.2f} ms to make a step's batches (their CPU time a batch "
                     "over their number), longer than its launches take")
        here = f"{c.host_ms:.2f} ms here, with the kernels' work done on this CPU"
        if c.bound == "host":
            return f"step clock: on an {name} this step would be host-bound: {model}; {least}; {here}{note}"
        if c.bound == "device":
            return (f"step clock: on an {name} this step would be device-bound: {model}, more than all of the "
                    f"host's {here}{note}")
        return (f"step clock: on an {name} this step's bound is not known from a rehearsal: {model}; {least}, "
                f"and takes {here}{note}")
    if c.bound is None or c.host_ms is None or c.device_ms is None:
        return f"step clock: the host's{note}" if c.note else None
    where = "CUDA events at the step boundaries" if c.source == "events" else "its kernels' busy time in the trace"
    busy = (f"; the device's own work {c.device_busy_ms:.2f} ms of it" if c.device_busy_ms is not None else "")
    if c.bound == "device" and c.device_ms <= c.host_ms and c.waited_ms is not None:
        # (a recording whose host issues the step, then waits in its syncs for the device's work)
        return (f"step clock: device-bound: the device worked {c.device_ms:.2f} ms of each {c.host_ms:.2f} ms step "
                f"(median, {where}), the host waiting for it {c.waited_ms:.2f} ms in its syncs{note}")
    if c.bound == "device":
        return (f"step clock: device-bound: the device ran each step in {c.device_ms:.2f} ms (median, {where}); "
                f"the host issued it in {c.host_ms:.2f} ms and waited for the rest{busy}{note}")
    if c.source == "trace":
        return (f"step clock: host-bound: the host issued each step in {c.host_ms:.2f} ms; the device worked "
                f"{c.device_ms:.2f} ms of it ({where}){note}")
    return (f"step clock: host-bound: the host issued each step in {c.host_ms:.2f} ms; the device's clock read "
            f"{c.device_ms:.2f} ms ({where}){busy}{note}")


# Rules whose fixes take launches themselves off the host (fusing them: torch.compile; a foreach
# update in place of one launch a parameter): what they save lowers the launches' own floor under
# the step
LAUNCH_RULES = frozenset({"launch-bound", "manual-update"})


def rehearsed_share(evidence: Evidence, recoverable_ms: float,
                    launches_saved_ms: float = 0.0) -> tuple[float, float, str] | None:
    """For a CUDA program rehearsed on a CPU whose step would be host-bound on the named GPU: (the
    step predicted there, the part of it the fixes' `recoverable_ms` can give back, the GPU's name).
    The step measured here holds the kernels' work done on this CPU, so a share of it says little of
    the GPU step: the fixes save host time there, and the step cannot go below its launches' time
    on the host (less `launches_saved_ms`, what the LAUNCH_RULES' fixes among them save by
    launching fewer kernels) nor its kernels' on the GPU.
    None where the step is not predicted host-bound (device-bound or unknown: the device model's
    kernel estimate alone is no step time)."""
    c = step_clock(evidence)
    if c.source != "estimate" or c.bound != "host" or not c.issue_floor_ms or c.device_ms is None:
        return None
    name = _gpu_name(evidence)
    predicted = max(c.issue_floor_ms, c.device_ms)
    # (the least the step can take once the fixes are in: its launches on the host, its kernels on the GPU)
    per_step = rehearsed_host_steps(evidence, evidence.median_basis()) or []
    launches = statistics.median(host - wait for wait, host in per_step) if per_step else 0.0
    floor = max(c.device_ms, launches - launches_saved_ms)
    return predicted, max(0.0, min(recoverable_ms, predicted - floor)), name


def gpu_line(predicted: float, saved: float, name: str) -> str:
    """A rehearsal's prediction for the named GPU, on a line of its own: no share of the run
    measured here is a share of it."""
    what = (f"save up to {saved:.2f} ms" if saved >= 0.01 else f"save up to {saved:.3g} ms" if saved > 0
            else "save nothing there")  # (a few us is not "0.00")
    return (f"predicted on an {name} (rehearsal, not measured): {predicted:.2f} ms/step, host-bound; "
            f"fixes {what}")


def _gpu_name(evidence: Evidence) -> str:
    """The GPU a rehearsal is judged on (`--device`, else the default row)."""
    estimate = rehearsed_device_ms(evidence)
    return estimate[1] if estimate is not None else "the named GPU"
