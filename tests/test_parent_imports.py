"""What an audit's own process imports: an audit without a trace (`--no-profile`) never imports
pandas (0.45 s), plotly's figure classes (the page's template is shipped as JSON; plotly.js is read
from plotly's package) or libcst (imported by the first code edit): about half a second of CPU an
audit, which every audit of the suite paid."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow


def test_an_audit_without_a_trace_imports_no_pandas_plotly_or_libcst(tmp_path):
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "auditor", "run", "examples/clean.py:step",
                        "--steps", "2", "--no-profile", "--quiet", "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, cwd=ROOT, timeout=240, env={"OMP_NUM_THREADS": "1", **os.environ})
    assert p.returncode == 0, p.stderr[-2000:]
    imported = {m.group(1) for m in re.finditer(r"^import time:.*\|\s*(\S+)$", p.stderr, re.M)}
    assert {"auditor.cli", "numpy"} <= imported  # (what it reads is the parent's own import log)
    heavy = {m for m in imported if m.split(".")[0] in ("pandas", "libcst")
             or m in ("plotly.basedatatypes", "plotly.graph_objs", "plotly.graph_objects")}
    assert not heavy, sorted(heavy)
    assert (tmp_path / "out" / "report.html").exists() and (tmp_path / "out" / "findings.json").exists()
