"""The CLI's own contract: rules, explain, fail-on, quiet, analyze/report of a saved run."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, audit

RULES = ["anomaly-mode", "retained-graph", "graph-leak", "host-sync", "peak-stats-reset", "forced-cleanup",
         "dataloader-bound", "step-slowdown", "hook-leak", "memory-growth", "allocator-fragmentation", "oom-risk",
         "pageable-copy", "gpu-idle", "launch-bound", "dataloader-on-device", "amp-opportunity",
         "rank-straggler", "collective-wait", "ddp-config", "data-parallel"]


def test_rules_lists_every_rule(tmp_path):
    a = audit("rules", out=tmp_path)
    assert a.returncode == 0
    for r in RULES:
        assert r in a.stdout


def test_explain_prints_the_rule_docs(tmp_path):
    a = audit("explain", "host-sync", out=tmp_path)
    assert a.returncode == 0
    for heading in ("What it detects:", "Why it costs:", "Example:", "Fix:", "Evidence needed:", "min-share-of-steps"):
        assert heading in a.stdout


def test_every_rule_documents_itself():
    from auditor.rules.registry import all_rules

    for rule_id, cls in all_rules().items():
        docs = cls.docs()
        for heading in ("What it detects", "Why it costs", "Example", "Fix", "Evidence needed"):
            assert heading in docs, (rule_id, heading)


def test_fail_on_quiet_and_no_progress_when_not_a_tty(tmp_path):
    # (examples/forced_cleanup.py's step without its model and optimizer: a warning every run finds)
    trainer = tmp_path / "forced_cleanup.py"
    trainer.write_text("import gc\n\nimport torch\n\nw = torch.zeros(3)\n\n\ndef step():\n    w.add_(1)\n"
                       "    gc.collect()\n    torch.cuda.empty_cache()\n")
    a = audit("run", f"{trainer}:step", "--steps", "5", "--fail-on", "warning", "--no-profile", out=tmp_path / "o")
    assert a.returncode == 1
    assert "forced-cleanup" in a.stdout and "forced_cleanup.py:" in a.stdout
    assert "steps" not in a.stderr  # no progress bar off a TTY
    # (the same findings judged again, without a new run)
    a = audit("analyze", str(tmp_path / "o"), "--fail-on", "error", "--quiet", out=tmp_path / "o2")
    assert a.returncode == 0
    assert a.stdout.strip().splitlines() == [
        f"audit: {len(a.findings)} finding(s), run completed; report in {tmp_path / 'o2'}"]


PROBE_IMPORTS = """
import json, os, sys
import torch
IMPORT_INDUCTOR

x = torch.randn(64, 64, requires_grad=True)


def step(i):
    (x @ x).sum().backward()
    if i == 1:  # (the last step: the profiler started before it)
        with open(os.environ["IMPORTS_OUT"], "w") as f:
            json.dump({"inductor": "torch._inductor" in sys.modules,
                       "getattr_is_torchs": torch.__getattr__.__module__ == "torch"}, f)
"""


@pytest.fixture(scope="module")
def probe_audit(tmp_path_factory):
    """PROBE_IMPORTS audited for two steps, both profiled, --quiet, once per module for each
    `user_imports_inductor`: (the audit, the imports the step saw)."""
    runs = {}

    def get(user_imports_inductor: bool):
        if user_imports_inductor not in runs:
            tmp = tmp_path_factory.mktemp("probe")
            (tmp / "t.py").write_text(PROBE_IMPORTS.replace(
                "IMPORT_INDUCTOR", "import torch._inductor.config" if user_imports_inductor else ""))
            a = audit("run", f"{tmp / 't.py'}:step", "--steps", "2", "--quiet", out=tmp / "o",
                      env={"IMPORTS_OUT": str(tmp / "imports.json")})
            assert a.returncode == 0, a.stderr
            runs[user_imports_inductor] = (a, json.loads((tmp / "imports.json").read_text()))
        return runs[user_imports_inductor]

    return get


def test_a_short_profiled_run_says_nothing_of_its_own_on_stderr(probe_audit):
    """Two steps, profiled (no step to spare for warm-up): torch's warning about the auditor's
    own profiler schedule is not the user's business, and stderr stays empty."""
    a, _ = probe_audit(False)
    assert a.stderr.strip() == "" and a.findings_doc["steps"]["profiled_steps"]


@pytest.mark.parametrize("user_imports_inductor", [False, True])
def test_profiling_does_not_import_inductor_for_the_user(probe_audit, user_imports_inductor):
    """torch.profiler's start imports torch._inductor (and dynamo) to read one flag: 1.6 s of a
    short audit, spent on a module the trainer never used. The auditor starts it without that
    import; a trainer that uses inductor keeps it, and torch's module is left as it was."""
    a, seen = probe_audit(user_imports_inductor)
    assert a.findings_doc["steps"]["profiled_steps"] and a.evidence["traces"]
    assert seen == {"inductor": user_imports_inductor, "getattr_is_torchs": True}


def test_analyze_and_report_rerun_rules_on_a_saved_run(tmp_path, example_audit):
    run = example_audit("graph_leak")
    again = audit("analyze", str(run.out), "--quiet", out=tmp_path / "again")
    assert again.returncode == 0, again.stderr
    assert [f["rule"] for f in again.findings] == [f["rule"] for f in run.findings]
    assert again.findings_doc["steps"] == run.findings_doc["steps"]
    (run.out / "findings.json").unlink()
    rep = audit("report", str(run.out), out=run.out)
    assert rep.returncode == 0, rep.stderr
    assert json.loads((run.out / "findings.json").read_text())["findings"][0]["rule"] == "graph-leak"


def test_python_dash_m_is_the_same_cli():
    p = subprocess.run([sys.executable, "-m", "auditor", "--version"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.startswith("audit, version")


def test_progress_bar_on_a_tty_and_not_with_quiet(tmp_path):
    """On a terminal, stderr shows the progress bar while steps run; --quiet suppresses it."""
    import os
    import pty

    # (a step without an optimizer: the bar is the audit's, whatever the step does)
    (tmp_path / "tiny.py").write_text("import torch\nw = torch.zeros(3)\n\n\ndef step():\n    w.add_(1)\n")

    def stderr_on_tty(*extra: str) -> str:
        master, slave = pty.openpty()
        p = subprocess.Popen([sys.executable, "-m", "auditor", "run", f"{tmp_path / 'tiny.py'}:step", "--steps", "6",
                              "--no-profile", "--out", str(tmp_path / f"o{len(extra)}"), *extra],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=slave, stdin=subprocess.DEVNULL)
        os.close(slave)
        chunks = []
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        p.wait(timeout=120)
        os.close(master)
        assert p.returncode == 0
        return b"".join(chunks).decode(errors="replace")

    shown = stderr_on_tty()
    assert "audit" in shown and "6/6" in shown
    assert stderr_on_tty("--quiet").strip() == ""


def test_a_runs_damaged_trace_is_a_note_not_a_failure(tmp_path, example_audit):
    """`audit report` / `analyze` of a run whose trace was cut short (a full disk, a kill while it was
    written) keep the run's other evidence, as `audit run` does: only that trace is left out."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(example_audit("graph_leak").out, run)
    [trace] = json.loads((run / "evidence.json").read_text())["traces"]
    data = (run / trace).read_bytes()
    (run / trace).write_bytes(data[: len(data) // 2])
    for args in (("report", str(run)), ("analyze", str(run), "--quiet")):
        a = audit(*args, out=tmp_path / "again" if args[0] == "analyze" else run)
        assert a.returncode == 0, a.stderr
        doc = a.findings_doc
        assert [f["rule"] for f in doc["findings"]] == ["graph-leak"]
        assert any(n.startswith("profiler trace not analysed:") and "truncated" in n
                   for n in doc["environment"]["notes"]), doc["environment"]["notes"]
