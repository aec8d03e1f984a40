"""A trace names a Python frame by its def line: trace findings are placed at the line of the
frame's body that calls what ran below it, where exactly one line does and the source is here."""
from __future__ import annotations

import pytest

from auditor.evidence.load import load_paths
from auditor.rules.engine import run_rules

from conftest import EXAMPLES, FIXTURES

H100 = FIXTURES / "h100"


@pytest.mark.parametrize("name, rule, lines", [
    ("demo", "pageable-copy", [46]),                 # x, y = x.to(device), y.to(device)
    ("demo", "host-sync", [46, 52]),                 # .to's copy sync; loss.item() in log.append
    ("gpu_manual_update", "manual-update", [36]),    # p.data.add_(p.grad, alpha=-lr)  # expect
    ("gpu_small_launches", "host-sync", [61]),       # losses.append(loss.item())  # expect
])
def test_trace_findings_name_the_calls_line(name: str, rule: str, lines: list[int],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain H100 traces name `step` by its def line (demo.py:38, gpu_manual_update.py:29,
    gpu_small_launches.py:53); with the examples' source here, each finding is at the line of the
    step's body that calls what ran below the frame (the only one calling it)."""
    monkeypatch.chdir(EXAMPLES)  # the recordings name the examples by their file name
    found = [f for f in run_rules(load_paths([H100 / "plain" / f"plain_{name}.json.gz"])).findings
             if f.rule == rule]
    assert sorted(f.locations[0].line for f in found) == lines
    for f in found:
        loc = f.locations[0]
        assert loc.file == f"{name}.py" and not loc.code.startswith("def ") and loc.note == ""
