"""Cheap runtime probes on the torch APIs that cause trouble.

Each probe wraps one API, attributes the call to the user's line and adds it to a per-step tally
(count and time). Probes never change arguments or results: audited and plain runs compute the
same numbers. They are installed before the target module is imported, so module-level calls
(e.g. `torch.autograd.set_detect_anomaly(True)`) are seen too.

Calls made by torch itself (e.g. `Tensor.backward` calling `torch.autograd.backward`, or
`Tensor.__format__` calling `.item()`) are not counted again: only calls whose immediate caller is
outside torch and the auditor are.

Modules: recorder (the tallies, REC), wrappers (how a probe wraps an API), syncs, timed_calls,
anomaly, backward (and retained graphs), phases (forward and optimizer), optimizer_updates (torch's
own, passed over), data, workers, dist, hook_probes, indexing, graph_use; installation (install).
"""
from auditor.capture.probes.backward import on_backward_start, read_backward_calls
from auditor.capture.probes.installation import install
from auditor.capture.probes.optimizer_updates import update_begins, update_ends
from auditor.capture.probes.phases import forward_done, optimizer_done, take_over_phase_timing
from auditor.capture.probes.recorder import (REC, FrameKey, Recorder, read_traced_steps, settle_traced_steps,
                                             traced_optimizer_step, unread_traced_steps)
from auditor.capture.probes.syncs import judge_as_gpu_code, judged_as_gpu_code, mask_index_sync
from auditor.capture.probes.wrappers import set_part_probes

__all__ = ["REC", "FrameKey", "Recorder", "forward_done", "install", "judge_as_gpu_code", "judged_as_gpu_code",
           "mask_index_sync", "on_backward_start", "optimizer_done", "read_backward_calls", "read_traced_steps", "set_part_probes",
           "settle_traced_steps", "take_over_phase_timing", "traced_optimizer_step", "unread_traced_steps",
           "update_begins", "update_ends"]
