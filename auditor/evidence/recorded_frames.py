"""Python frames as recordings name them (profiler traces, memory snapshots), and whether a frame is
the user's: pure string work on paths from another machine, so it needs neither torch nor pandas.

(The live-process counterpart, which resolves real paths against the installed torch, is
auditor.capture.frames.)
"""
from __future__ import annotations

import re
import sys
from functools import lru_cache
from pathlib import Path

import auditor
from auditor.evidence.frame import Frame

_PY_FRAME = re.compile(r"^(?P<file>.+?)\((?P<line>\d+)\): (?P<func>.*)$")

_LIBRARY_ROOTS = frozenset({"torch", "torchvision", "torchaudio", "torchtext", "torchdata", "functorch",
                            "triton", "numpy", "tqdm", "typing_extensions", "_pytest", "pytest",
                            "pluggy", "auditor", "lightning", "pytorch_lightning", "lightning_fabric",
                            "accelerate", "deepspeed", "apex"}) | frozenset(sys.stdlib_module_names)


def parse_frame(text: str) -> Frame | None:
    """A Python frame from a profiler name like `train.py(42): step` (None for built-ins)."""
    m = _PY_FRAME.match(text.strip())
    if not m:
        return None
    return Frame(file=m.group("file"), line=int(m.group("line")), function=m.group("func"))


def is_library_file(file: str) -> bool:
    """True for frames the user cannot edit: torch, the standard library, site-packages.

    Kineto strips sys.path prefixes, so `torch/nn/modules/module.py` and `threading.py` arrive
    relative; absolute paths under site-packages are libraries as well.
    """
    f = file.replace("\\", "/")
    if f.startswith("<") or "site-packages/" in f or "dist-packages/" in f or "/lib/python" in f:
        return True
    if f.startswith("/"):
        return is_auditor_file(f)
    root = f.split("/", 1)[0]
    root = root.removesuffix(".py")
    return root in _LIBRARY_ROOTS


_PACKAGE = Path(auditor.__file__).resolve().parent


@lru_cache(maxsize=4096)
def is_auditor_file(file: str) -> bool:
    """True for an absolute path to one of the auditor's own modules, on this machine or another
    (`/src/auditor/capture/probes/data.py` from a run whose project root was /src): the part after
    its last `/auditor/` names a file of this auditor package. The audit's probes and checks sit
    between the user's line and torch in a run's trace, and are never the user's line."""
    f = file.replace("\\", "/")
    cut = f.rfind("/auditor/")
    return cut >= 0 and f.endswith(".py") and (_PACKAGE / f[cut + len("/auditor/"):]).is_file()
