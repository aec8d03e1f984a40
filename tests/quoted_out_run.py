"""One profiled audit shared by test_trace_path and test_reused_out (both about where a run's trace
is written, neither about a rule's detection): examples/host_sync.py, 4 steps, into an --out named
with a quote and a backslash that already holds an earlier audit's trace of another target (named
by that audit's evidence.json) and a trace of the user's own (named by none)."""
from __future__ import annotations

from pathlib import Path

from conftest import Audit, audit, shared

# (where the earlier audit's trace lies, relative to --out; and the user's own)
STALE = Path("tb") / "other-step" / "host_1.111.pt.trace.json"
USERS = Path("tb") / "host_sync-step" / "users_own.pt.trace.json"


def quoted_out_run(tmp_path_factory) -> Audit:
    """The run, made once per session even across xdist workers (conftest.shared): the --out is
    FOLDER/'quote"and\\backslash', FOLDER its own (nothing else is written there)."""
    def make(folder: Path) -> Audit:
        from auditor.evidence import model as m
        from auditor.evidence.store import save

        out = folder / 'quote"and\\backslash'
        for name in (STALE, USERS):
            (out / name).parent.mkdir(parents=True)
            (out / name).write_text('{"traceEvents": []}')
        save(m.Evidence(source="run", target="other.py:step", traces=[STALE.as_posix()]), out)
        return audit("run", "examples/host_sync.py:step", "--steps", "4", "--no-numerics", out=out)

    return shared(tmp_path_factory, "quoted-out-run", make)
