"""install(): every probe put in, once, before the target module is imported."""
from __future__ import annotations

import functools
import os

import torch

from auditor.capture import saved_tensors
from auditor.capture.probes.anomaly import _install_anomaly_probe
from auditor.capture.probes.backward import _install_backward_probes
from auditor.capture.probes.phases import _install_phase_hooks
from auditor.capture.probes.recorder import REC, Recorder
from auditor.capture.probes.syncs import _install_sync_probes
from auditor.capture.probes.timed_calls import _install_timed_probes
from auditor.capture.probes.wrappers import _WRAPPED, _part_on, _user_call, _wrap


_INSTALLED: list[bool] = []


def install() -> Recorder:
    """Install every probe (idempotent) and return the process's recorder, active from now on."""
    if not _INSTALLED:
        _INSTALLED.append(True)
        REC.active = True
        from auditor.capture.bench_switches import OFF, TOGGLED

        _part_on[1] = bool(TOGGLED)  # (bench_steady_parts.py --toggle only: the part's wrappers kept, to swap)
        if "probes" not in OFF:  # (bench_steady_parts.py only)
            _install_sync_probes()
            _install_timed_probes()
            _install_anomaly_probe()
        _part_on[1] = False
        _install_backward_probes()
        if not saved_tensors.PACKED_FORM:  # (torch 2.4: a graph's saved tensors read only before any hooks)
            _wrap(torch.autograd.graph.saved_tensors_hooks, "__enter__", saved_tensors.noting_entered)
        _part_on[1] = bool(TOGGLED)
        if "probes" not in OFF:
            from auditor.capture.probes.hook_probes import install_hook_probes

            install_hook_probes(_wrap, lambda: REC, lambda: _user_call(3))
        _part_on[1] = False
        _install_phase_hooks()
        from auditor.capture.probes.data import install_dataloader_probes, install_sampler_probes

        install_dataloader_probes(REC, _wrap)
        from auditor.capture.probes import workers

        os.register_at_fork(after_in_child=functools.partial(workers.forked, _WRAPPED))
        install_sampler_probes(REC, _wrap)
    return REC
