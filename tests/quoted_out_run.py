"""One profiled audit shared by test_trace_path and test_reused_out (both about where a run's trace
is written, neither about a rule's detection): examples/host_sync.py, 4 steps, into an --out named
with a quote and a backslash that already holds an earlier audit's trace of another target."""
from __future__ import annotations

from pathlib import Path

from conftest import Audit, audit, shared

# (where the earlier audit's trace lies, relative to --out)
STALE = Path("tb") / "other-step" / "host_1.111.pt.trace.json"


def quoted_out_run(tmp_path_factory) -> Audit:
    """The run, made once per session even across xdist workers (conftest.shared): the --out is
    FOLDER/'quote"and\\backslash', FOLDER its own (nothing else is written there)."""
    def make(folder: Path) -> Audit:
        out = folder / 'quote"and\\backslash'
        stale = out / STALE
        stale.parent.mkdir(parents=True)
        stale.write_text('{"traceEvents": []}')
        return audit("run", "examples/host_sync.py:step", "--steps", "4", "--no-numerics", out=out)

    return shared(tmp_path_factory, "quoted-out-run", make)
