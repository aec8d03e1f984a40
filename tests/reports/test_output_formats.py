"""Every output is valid for its format, whatever the recording holds. A trace whose events lack
`ts`/`dur` made findings.sarif invalid JSON (bare NaN), the gpu-idle message say "nan%" and numpy
warn on stderr: such events are left out where the trace is read, counted in one summary line, and
findings.sarif validates against the SARIF 2.1.0 schema."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from conftest import FIXTURES, ROOT, audit

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (pip install jsonschema)")
SCHEMA = json.loads((ROOT / "tests" / "data" / "sarif-schema-2.1.0.json").read_text())
CONVNET = FIXTURES / "h100" / "plain" / "plain_gpu_convnet.json.gz"


def strict(text: str):
    """JSON as the standard has it: NaN and Infinity are no tokens of it."""
    def refuse(token: str):
        raise ValueError(f"not JSON: {token}")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("cats, dropped", [
    (("kernel",), 114),  # kernels without a time: numpy warned on their NaN starts
    (("kernel", "cuda_runtime", "cpu_op"), 1354),  # most events without one: NaN in SARIF, "nan%"
])
def test_events_without_times_leave_every_output_valid(tmp_path: Path, cats: tuple[str, ...], dropped: int) -> None:
    doc = json.loads(gzip.open(CONVNET).read())
    for e in doc["traceEvents"]:
        if e.get("cat") in cats:
            e.pop("ts", None)
            e.pop("dur", None)
    trace = tmp_path / "untimed.json"
    trace.write_text(json.dumps(doc))
    a = audit("analyze", str(trace), out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    assert "Warning" not in a.stderr, a.stderr
    sarif = strict((a.out / "findings.sarif").read_text())
    validator = jsonschema.Draft7Validator(SCHEMA)
    assert not list(validator.iter_errors(sarif))
    strict((a.out / "findings.json").read_text())
    strict((a.out / "evidence.json").read_text())
    for text in (a.stdout, (a.out / "summary.txt").read_text()):
        assert "nan" not in text.lower().replace("nanosec", "")
    assert (f"untimed.json: {dropped:,} events with fields of the wrong type or impossible values were left out "
            f"(the first: ") in a.stdout
    assert '"ts" is missing)' in a.stdout


def test_impossible_durations_are_left_out_and_said(tmp_path: Path) -> None:
    """A kernel lasting 1e300 µs made the GPU "busy" for the whole trace and gpu-idle vanish; one of
    -5 µs is no measurement either. Both are left out, and the summary says so; the rest is judged
    as without them."""
    doc = json.loads(gzip.open(CONVNET).read())
    kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
    kernels[0]["dur"], kernels[1]["dur"] = 1e300, -5
    trace = tmp_path / "spoilt.json"
    trace.write_text(json.dumps(doc))
    a = audit("analyze", str(trace), out=tmp_path / "out")
    b = audit("analyze", str(CONVNET), out=tmp_path / "plain")
    assert a.returncode == b.returncode == 0, a.stderr + b.stderr
    assert ("spoilt.json: 2 events with fields of the wrong type or impossible values were left out (the first: "
            in a.stdout) and "which no recorded event lasts)" in a.stdout
    assert a.rule("gpu-idle") and b.rule("gpu-idle")
