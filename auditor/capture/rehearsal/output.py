"""CUDA rehearsal, the program's output: what a library logs only because of the rehearsal stays out of it.

The rehearsal answers a library's device queries as a GPU would, and a library then logs what it
logs on a GPU machine: Lightning's "You are using a CUDA device ('CUDA device rehearsed on the
CPU') that has Tensor Cores ..." hint, its "LOCAL_RANK: 0 - CUDA_VISIBLE_DEVICES: [0]". A plain run
here prints neither, and neither is the program's. A log record that names the rehearsed device,
or is Lightning's CUDA-devices line, is held back from every handler (`logging.Logger.handle`) and
kept for the report's environment notes (auditor.capture.held_output); every other record, the
program's own prints and its warnings reach the output as in a plain run. (torch's own warning of
CPU autocast refusing a GPU dtype is left out where the rehearsal makes it: rehearsal.cuda.)
"""
from __future__ import annotations

import logging
import re
from typing import Any

from auditor.capture import held_output
from auditor.capture.rehearsal.cuda import DEVICE_NAME

_LIGHTNING_DEVICES = re.compile(r"LOCAL_RANK: \d+ - CUDA_VISIBLE_DEVICES: ")


def rehearsals_own(record: logging.LogRecord) -> bool:
    """Whether a log record is the rehearsal's doing (see module doc)."""
    try:
        text = record.getMessage()
    except Exception:  # (a record whose arguments do not fit its message: the handlers report it)
        return False
    return DEVICE_NAME in text or (record.name.startswith(("lightning", "pytorch_lightning"))
                                   and _LIGHTNING_DEVICES.match(text) is not None)


def install() -> None:
    orig = logging.Logger.handle
    if getattr(orig, "__rehearsal_original__", None) is not None:
        return

    def handle(self: logging.Logger, record: logging.LogRecord) -> Any:
        if rehearsals_own(record):
            held_output.hold(f"{record.name}: {record.getMessage()}")
            return None
        return orig(self, record)

    handle.__rehearsal_original__ = orig  # type: ignore[attr-defined]
    logging.Logger.handle = handle  # type: ignore[method-assign]
