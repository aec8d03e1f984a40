"""Anomaly detection turned on (`torch.autograd.set_detect_anomaly(True)`), at the user's line."""
from __future__ import annotations

import sys

import torch

from auditor.capture.frames import user_frame
from auditor.capture.probes.recorder import REC
from auditor.capture.probes.wrappers import _compiling, _wrap
from auditor.evidence import model as m


def _install_anomaly_probe() -> None:
    def make(orig):
        def probe(enabled, *args, **kwargs):
            out = orig(enabled, *args, **kwargs)  # (torch judges the arguments first: a bad one raises its error)
            rec = REC
            if torch.is_anomaly_enabled() and rec.active and not _compiling():
                rec.add(m.ANOMALY_ON, "anomaly detection", user_frame(sys._getframe(1)))
            return out
        return probe
    _wrap(torch, "set_anomaly_enabled", make)
