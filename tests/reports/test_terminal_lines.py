"""The default summary a person reads in ten seconds, on README command 1's kept run (the run
tests/fixtures/docs/audited_train_script keeps, re-rendered with `audit report`): at most three lines
on the run, then one line a finding in ruff's shape, `severity rule file:line cost sentence`, each
no wider than the terminal (120 where its width is not known); `--verbose` prints the detail."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import FIXTURES, ROOT

# severity (padded to 7), rule id, file:line, cost (ms a step and share, `~` estimated; or
# "counted"), then one sentence
LINE = re.compile(r"^(?P<sev>error|warning|info) +(?P<rule>[a-z0-9-]+) (?P<where>\S+:\d+) "
                  r"(?P<cost>(?P<est>~)?(?P<ms>[\d.]+) ms (?P<share>\d+)%|counted) (?P<sentence>.+)$")


def _report(run, *args: str) -> list[str]:
    done = subprocess.run([sys.executable, "-m", "auditor", "report", str(run), "--source-root", str(ROOT), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = tmp_path_factory.mktemp("terminal") / "audited_train_script"
    shutil.copytree(FIXTURES / "docs" / "audited_train_script", run)
    return run


@pytest.fixture(scope="module")
def printed(run) -> list[str]:
    return _report(run)


def test_readme_command_ones_summary_fits_ten_seconds(printed):
    text = "".join(line + "\n" for line in printed)
    assert len(printed) <= 20 and len(text) <= 2000, text
    assert max(map(len, printed)) <= 120, text


def test_three_lines_on_the_run_then_one_a_finding(run, printed):
    doc = json.loads((run / "findings.json").read_text())
    head, account, gains = printed[:3]
    assert head == "audit of examples/train_script.py: 30 step(s), median 32.4 ms/step, CUDA rehearsed on the CPU"
    assert account.startswith(f"run's time: {doc['run_time']['base_ms']:.1f} ms/step (30 steps, ")
    assert re.match(r"fixes give back up to 15\.8 ms/step \(45%, partly estimated\); on an A100 SXM4 80GB: "
                    r"[\d.]+ of a predicted [\d.]+ ms/step$", gains), gains
    lines = [m for line in printed[3:] if (m := LINE.match(line))]
    assert [m["rule"] for m in lines] == [f["rule"] for f in doc["findings"]]
    for m, f in zip(lines, doc["findings"]):
        assert m["sev"] == f["severity"]
        loc = f["locations"][0]
        assert m["where"] == f"{os.path.relpath(loc['file'], ROOT)}:{loc['line']}"
        cost = f["cost"]
        if cost["ms_per_step"] is None:
            assert m["cost"] == "counted"
        else:
            assert float(m["ms"]) == pytest.approx(cost["ms_per_step"], abs=0.051)
            assert int(m["share"]) == round(cost["share_of_step"] * 100)
            assert bool(m["est"]) == (not cost["measured"])
        # one sentence: the message's first, the rest left to the report
        assert f["message"].startswith(m["sentence"]) and len(m["sentence"]) < len(f["message"])
        assert not re.search(r"[.!?] [A-Z0-9(]", m["sentence"]), m["sentence"]
    dataloader = LINE.match(printed[3])
    assert dataloader["rule"] == "dataloader-bound" and dataloader["where"] == "examples/train_script.py:56"
    assert dataloader["sentence"] == "Steps wait for data: load it in DataLoader workers."
    assert printed[-2].startswith("report: ") and printed[-1] == "also there: findings.json, findings.sarif, fixes.patch"


def test_a_narrow_terminal_cuts_the_finding_lines_at_its_width(run):
    from auditor.evidence.load import load_paths
    from auditor.reports.terminal import brief_lines
    from auditor.rules.engine import run_rules
    from auditor.config import Config

    evidence = load_paths([run])
    narrow = [line.plain for line in brief_lines(evidence, run_rules(evidence, Config()), run, width=72)]
    findings = [line for line in narrow if line.startswith(("warning ", "info "))]
    assert len(findings) == 5 and all(len(line) <= 72 for line in findings), findings
    assert any(line.endswith("…") for line in findings)
    assert all(len(line) <= 72 for line in narrow[1:3]), narrow[1:3]  # (wrapped at words, nothing lost)
    assert "".join(narrow[1:]).startswith("run's time: 35.0 ms/step")


def test_verbose_prints_the_detail(run, printed):
    full = _report(run, "--verbose")
    assert any(line.startswith("step clock: on an NVIDIA A100 SXM4 80GB this step would be host-bound") for line in full)
    assert any(line.startswith("the audit's own cost, measured: ") for line in full)
    [line] = [ln for ln in full if ln.startswith("warning dataloader-bound ")]
    assert "Confidence: high (15 of 15 steps" in line and line.endswith("(15.44 ms/step, 44%)")
    assert len(full) > len(printed) and max(map(len, full)) > 120
