"""A run's trace holds the audit's own probes and checks between the user's line and torch; they are
never the user's line, also when the trace names them by absolute path (the H100 audit of
examples/train_script.py placed gpu-idle at /src/auditor/capture/probes/data.py:94, pageable-copy
at /src/auditor/capture/probes/__init__.py:261, cudnn-benchmark at .../numerics/mode.py:32)."""
from __future__ import annotations

import gzip
from pathlib import Path

from auditor.evidence.model import Evidence
from auditor.evidence.recorded_frames import is_library_file
from auditor.evidence.trace.load import load_trace
from auditor.rules.gpu_idle import GpuIdle

from conftest import FIXTURES

RUN = FIXTURES / "h100" / "audited" / "audited_gpu_clean"


def test_the_auditors_modules_by_absolute_path_are_not_the_users() -> None:
    for path in ("/src/auditor/capture/probes/data.py", "/src/auditor/capture/probes/__init__.py",
                 "/src/auditor/capture/numerics/mode.py", "/opt/venv/x/auditor/capture/graphs.py"):
        assert is_library_file(path), path
    for path in ("/src/examples/gpu_clean.py", "/home/me/auditor/train.py", "/home/me/auditor/data.py"):
        assert not is_library_file(path), path


def test_gpu_idle_on_a_run_trace_naming_the_auditor_by_absolute_path(tmp_path: Path) -> None:
    """The audited gpu_clean window, its auditor frames named as train_script's run named them
    (/src/auditor/...): gpu-idle is placed at the example's lines, as with the relative names."""
    (trace,) = (RUN / "tb").rglob("*.pt.trace.json.gz")
    text = gzip.open(trace, "rt").read()
    assert text.count('"auditor/capture/') > 100
    absolute = tmp_path / "absolute.pt.trace.json.gz"
    with gzip.open(absolute, "wt") as f:
        f.write(text.replace('"auditor/capture/', '"/src/auditor/capture/'))
    files = []
    for path in (trace, absolute):
        ev = Evidence(source="trace", traces=[str(path)])
        ev.__dict__["trace_data"] = [load_trace(path)]
        rule = GpuIdle()
        (finding,) = rule.check(ev, rule.default_options())
        files.append([(loc.file, loc.line) for loc in finding.locations])
    assert files[1] == files[0] and files[0][0][0] == "gpu_clean.py"
