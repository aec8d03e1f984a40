"""One profiled audit shared by test_trace_path and test_reused_out (both about where a run's trace
is written, neither about a rule's detection): examples/host_sync.py, 4 steps, into an --out named
with a quote and a backslash that already holds an earlier audit's trace of another target."""
from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from conftest import Audit, audit

# (where the earlier audit's trace lies, relative to --out)
STALE = Path("tb") / "other-step" / "host_1.111.pt.trace.json"


def quoted_out_run(tmp_path_factory) -> Audit:
    """The run, made once per session even across xdist workers (as conftest.shared_audit makes its
    audits): the --out is FOLDER/'quote"and\\backslash', FOLDER its own (nothing else is written there)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "quoted-out-run"
    root.mkdir(exist_ok=True)
    out, done = root / 'quote"and\\backslash', root / "done.json"
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            stale = out / STALE
            stale.parent.mkdir(parents=True)
            stale.write_text('{"traceEvents": []}')
            a = audit("run", "examples/host_sync.py:step", "--steps", "4", "--no-numerics", out=out)
            done.write_text(json.dumps({"returncode": a.returncode, "stdout": a.stdout, "stderr": a.stderr}))
    return Audit(**json.loads(done.read_text()), out=out)
