"""`audit analyze` / `audit report` run in the test's own process: those commands run no program, so
the entry point `python -m auditor` calls (auditor.cli.main) is called here, with its output and
exit status captured as `conftest.audit` captures a process's; a process's start (~1-2 s of CPU:
the interpreter, the auditor's imports, its teardown) is what is saved."""
from __future__ import annotations

import os
from pathlib import Path

from click.testing import CliRunner

from conftest import ROOT, Audit

IN_PROCESS = ("analyze", "report")  # (commands that start no program)


def audit_here(*args: str, out: Path, cwd: Path | None = None) -> Audit:
    """`audit ARGS --out OUT`, as `conftest.audit` builds it, run by auditor.cli.main in this process."""
    from auditor.cli import main

    assert args and args[0] in IN_PROCESS, args
    argv = list(args)
    if args[0] == "analyze" and "--out" not in argv:
        at = argv.index("--") if "--" in argv else len(argv)
        argv[at:at] = ["--out", str(out)]
    here, code = os.getcwd(), 0
    with CliRunner().isolation() as (stdout, stderr, _):
        os.chdir(cwd or ROOT)
        try:
            main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            os.chdir(here)
        return Audit(code, stdout.getvalue().decode(), stderr.getvalue().decode(), out)
